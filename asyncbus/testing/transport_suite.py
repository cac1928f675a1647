"""The conformance suite every transport must pass.

Subclass :class:`TransportSuite` in a test module and provide a ``transport``
fixture that yields an entered transport whose broker names carry a prefix unique
to the test::

    from collections.abc import AsyncIterator

    import pytest

    from asyncbus.testing.transport_suite import TransportSuite
    from asyncbus.transports import RedisTransport, Transport


    class TestRedis(TransportSuite):
        ack_timeout = 1.0

        @pytest.fixture
        def anyio_backend(self) -> str:
            return "asyncio"  # redis-py runs on asyncio only

        @pytest.fixture
        async def transport(self, redis_url: str, unique_prefix: str) -> AsyncIterator[Transport]:
            async with RedisTransport(
                redis_url, prefix=unique_prefix, ack_timeout=self.ack_timeout
            ) as transport:
                yield transport
            # ... delete the broker names under unique_prefix here

        async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
            ...  # publish a valid envelope on ``topic`` whose body is ``body``

What a transport cannot do natively is told by ``transport.capabilities``, and
what it offers beyond the core by the optional protocols it implements
(:class:`~asyncbus.transports.DeadLetterStore`,
:class:`~asyncbus.transports.SharedDeadLetters`,
:class:`~asyncbus.transports.RoutedPublisher`, ...); the tests that need one are
skipped, and a transport that claims one must honour it. The suite relies on one thing beyond the
interface's docstrings: a group exists once ``subscribe`` has been *entered*, so
envelopes published after that reach it even before anyone iterates.

Every wait runs under a deadline (:attr:`TransportSuite.timeout`); the only
sleeps are short ones (:data:`QUIET`) that prove something does *not* arrive.
Failures are ``AssertionError`` with a message, never ``pytest.fail``: a
``BaseException`` escaping a task group stops anyio's test runner before the
``transport`` fixture's teardown, which would leave broker names behind.
"""

from __future__ import annotations

from ._suite.bodies import BodyTests
from ._suite.consumers import ConsumerTests
from ._suite.contract import ContractTests
from ._suite.dead_letters import DeadLetterTests
from ._suite.groups import GroupTests
from ._suite.publishing import PublishTests
from ._suite.routing import RoutingTests
from ._suite.settling import SettlingTests
from ._suite.support import QUIET

__all__ = ["QUIET", "TransportSuite"]


# pytest collects a base class's tests before those of the classes after it in the
# method resolution order, so the parts are listed last first: the tests run in the
# order of the themes (the contract, publish and subscribe, settling, ... groups).
class TransportSuite(
    GroupTests,
    BodyTests,
    RoutingTests,
    ConsumerTests,
    DeadLetterTests,
    SettlingTests,
    PublishTests,
    ContractTests,
):
    """Tests every transport must pass; subclass it with a ``transport`` fixture.

    The subclass provides:

    * ``transport``: an async-generator fixture yielding an *entered* transport
      whose broker names use a prefix unique to the test (``unique_prefix``), and
      which removes them afterwards.
    * ``anyio_backend`` (optional): a fixture override returning ``"asyncio"``
      when the client library runs on asyncio only.
    * :attr:`ack_timeout` (optional): the ``ack_timeout`` it gives its transport;
      ``None`` (the default) skips the test of a consumer that hangs or dies.
    * :meth:`publish_raw` (optional): publish a body that does not decode.
    """
