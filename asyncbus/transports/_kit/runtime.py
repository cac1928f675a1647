"""The check made by every transport whose client library runs on asyncio only."""

from __future__ import annotations

from ..._exceptions import ConnectError
from ..._runtime import current_backend

__all__ = ["require_asyncio"]


def require_asyncio(transport: str, client: str) -> None:
    """Refuse to connect anywhere but on asyncio (plain or uvloop).

    :param transport: the transport's class name, for the message.
    :param client: the client library that needs asyncio.
    :raises ConnectError: (a :class:`~asyncbus.TransportError`) on another backend.
    """
    library = current_backend()
    if library != "asyncio":
        raise ConnectError(
            f"{transport} runs on asyncio only ({client}), not {library}: "
            "use anyio's asyncio backend"
        )
