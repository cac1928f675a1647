"""Private broker servers for crash and restart tests: never the shared services.

A test that kills, restarts or wipes a broker starts its own on a free loopback port,
with its files in a temporary directory of the test::

    async with private_redis(tmp_path) as server:
        url = server.url
        await server.restart(fresh=True)   # kill -9, wipe its files, start again

The process is started by the test (in a session of its own) and only its process
group is ever killed. When the server binary is missing the test is skipped, or fails
under ``ASYNCBUS_REQUIRE_SERVICES=1`` (CI), like the shared brokers' fixtures.

* ``private_redis(..., persistent=True)`` writes an append-only file before each
  reply (``appendfsync always``): what it confirmed survives ``kill -9``.
* ``private_nats`` keeps JetStream's file store in the directory;
  ``private_nats_cluster`` starts three of them as one JetStream cluster (routes on
  loopback ports), each node its own :class:`PrivateServer`.
* ``RedisClusterNodes`` is a Redis Cluster of its own (three masters, a replica each,
  ``cluster-node-timeout`` 1 s: a replica takes over 2-3 s after its master's
  ``kill -9``), started without an event loop so a module can share one.
* ``private_rabbit`` is a RabbitMQ node of its own (its own name, ports, data and an
  empty plugin list); it takes 5-15 s to start. ``private_rabbit_cluster`` starts three
  such nodes (one Erlang cookie, an epmd of their own) and joins them into one cluster
  (:class:`RabbitCluster`: about 15 s; a node killed and started again rejoins in
  about 5 s).
* ``private_postgres`` is a PostgreSQL server of its own (``initdb`` on first start,
  trust authentication, user ``postgres``); run as the ``postgres`` user when the tests
  run as root, with its files in a directory of the system's temporary folder (the
  test's own is not open to that user).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

__all__ = [
    "PrivateServer",
    "RabbitCluster",
    "RedisClusterNodes",
    "free_port",
    "nats_connections",
    "private_nats",
    "private_nats_cluster",
    "private_postgres",
    "private_rabbit",
    "private_rabbit_cluster",
    "private_redis",
    "private_redis_replica",
]

#: Seconds a server may take to accept connections after it was started.
START_TIMEOUT = 15.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _binary(name: str, *fallbacks: str) -> str:
    found = shutil.which(name) or next((f for f in fallbacks if os.path.exists(f)), None)
    if found is None:
        message = f"{name} is not installed"
        if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; ASYNCBUS_REQUIRE_SERVICES=1 requires it", pytrace=False)
        pytest.skip(message)
    return found


class PrivateServer:
    """One broker server process of a test, on its own port and data directory.

    :param command: the command line for a port and a data directory.
    :param scheme: the URL scheme clients use.
    :param env: the environment for a port and a data directory (default: ours).
    :param userinfo: credentials in the URL (``user:password``), if any.
    :param start_timeout: seconds it may take to accept connections.
    """

    def __init__(
        self,
        command: Callable[[int, Path], list[str]],
        scheme: str,
        directory: Path,
        *,
        env: Callable[[int, Path], dict[str, str]] | None = None,
        userinfo: str = "",
        start_timeout: float = START_TIMEOUT,
        monitor_port: int | None = None,
        ready: Callable[[PrivateServer], Awaitable[bool]] | None = None,
    ) -> None:
        #: Whether the server, accepting connections, also serves them (PostgreSQL
        #: accepts while it recovers, refusing each with "starting up").
        self._ready = ready
        self._command = command
        #: The server's HTTP monitoring port, when it has one (NATS: ``-m``).
        self.monitor_port = monitor_port
        self._env = env
        self.port = free_port()
        self.directory = directory
        at = f"{userinfo}@" if userinfo else ""
        self.url = f"{scheme}://{at}127.0.0.1:{self.port}" + ("/" if scheme == "amqp" else "")
        self.start_timeout = start_timeout
        self._process: anyio.abc.Process | None = None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        assert not self.running, "the server is already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._process = await anyio.open_process(
            self._command(self.port, self.directory),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._env(self.port, self.directory) if self._env is not None else None,
            start_new_session=True,  # its own process group: killed as one, by us
        )
        with anyio.fail_after(self.start_timeout):
            while True:
                if self._process.returncode is not None:
                    raise RuntimeError(f"{self._command(self.port, self.directory)[0]} exited")
                try:
                    stream = await anyio.connect_tcp("127.0.0.1", self.port)
                except OSError:
                    await anyio.sleep(0.05)
                else:
                    await stream.aclose()
                    if self._ready is None or await self._ready(self):
                        return
                    await anyio.sleep(0.05)

    async def kill(self) -> None:
        """``kill -9`` the server (only this test's process) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                # The group this test started (a server may run helpers: RabbitMQ does).
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            await process.aclose()

    def pause(self, paused: bool = True) -> None:
        """Stop the server (``SIGSTOP``: its connections open, nothing answered), or
        let it go on (``paused=False``: ``SIGCONT``)."""
        assert self._process is not None, "the server is not running"
        os.killpg(self._process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    async def restart(self, *, fresh: bool = False) -> None:
        """Kill the server and start it again on the same port; ``fresh``: with its
        data directory emptied first (a server that lost its state)."""
        await self.kill()
        if fresh:
            shutil.rmtree(self.directory, ignore_errors=True)
        await self.start()


def _redis_command(port: int, directory: Path) -> list[str]:
    return [
        _binary("redis-server"),
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)),
        *("--save", "", "--appendonly", "no"),
    ]


def _persistent_redis_command(port: int, directory: Path) -> list[str]:
    return [
        *_redis_command(port, directory)[:-2],
        *("--appendonly", "yes", "--appendfsync", "always"),
    ]


_RABBIT = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def _rabbit_command(port: int, directory: Path) -> list[str]:
    # The node's own script: the system one switches to the rabbitmq user.
    return [_RABBIT if os.path.exists(_RABBIT) else _binary("rabbitmq-server")]


def _rabbit_env(node: str, dist_port: int) -> Callable[[int, Path], dict[str, str]]:
    def env(port: int, directory: Path) -> dict[str, str]:
        config = directory / "rabbitmq.conf"
        config.write_text(f"listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n")
        plugins = directory / "enabled_plugins"
        plugins.write_text("[].\n")
        (directory / "home").mkdir(exist_ok=True)
        return {
            **os.environ,
            "HOME": str(directory / "home"),
            "RABBITMQ_NODENAME": node,
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(plugins),
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_CONF_ENV_FILE": os.devnull,
        }

    return env


def _nats_command(port: int, directory: Path) -> list[str]:
    return [
        _binary("nats-server", "/usr/sbin/nats-server"),
        *("-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(directory)),
    ]


def _nats_command_with(*, jetstream: bool, monitor: int) -> Callable[[int, Path], list[str]]:
    def command(port: int, directory: Path) -> list[str]:
        line = [*_nats_command(port, directory), "-m", str(monitor)]
        if not jetstream:
            line.remove("-js")
        return line

    return command


@asynccontextmanager
async def _private(
    command: Callable[[int, Path], list[str]],
    scheme: str,
    directory: Path,
    **options: Any,
) -> AsyncIterator[PrivateServer]:
    command(0, directory)  # skips (or fails) now when the binary is missing
    server = PrivateServer(command, scheme, directory, **options)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


def _postgres_command(port: int, directory: Path) -> list[str]:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    server = str(found[-1]) if found else _binary("postgres")
    initdb = str(Path(server).with_name("initdb"))
    data = directory / "data"
    script = (
        f"test -f {data}/PG_VERSION || {{ {initdb} -D {data} -U postgres --auth=trust "
        f"-E UTF8 >/dev/null && echo 'CREATE DATABASE test;' | {server} --single -D {data} "
        "postgres >/dev/null; }; "
        # The lock files of a server this test killed (its pid may linger as a zombie).
        f"rm -f {data}/postmaster.pid {directory}/.s.PGSQL.*; "
        f"exec {server} -D {data} -p {port} -k {directory} "
        "-c listen_addresses=127.0.0.1 -c max_connections=200"
    )
    if os.geteuid() != 0:
        return ["sh", "-c", script]
    # PostgreSQL refuses to run as root: its files and process belong to postgres.
    shutil.chown(directory, "postgres", "postgres")
    directory.chmod(0o700)
    return ["runuser", "-u", "postgres", "--", "sh", "-c", script]


async def _postgres_serves(server: PrivateServer) -> bool:
    import asyncpg

    try:
        connection = await asyncpg.connect(
            f"postgresql://postgres@127.0.0.1:{server.port}/test", ssl=False, timeout=2
        )
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False  # "the database system is starting up", among others
    await connection.close()
    return True


@asynccontextmanager
async def private_postgres(directory: Path) -> AsyncIterator[PrivateServer]:
    """A PostgreSQL server of the test's own (see the module's docstring); ``directory``
    is not used: its files live in a temporary folder the server's user can reach, removed
    afterwards. Its URL names its database ``test``, as the shared server's does."""
    home = Path(tempfile.mkdtemp(prefix="asyncbus-pg-"))
    try:
        async with _private(
            _postgres_command,
            "postgresql",
            home,
            userinfo="postgres",
            start_timeout=30.0,
            ready=_postgres_serves,
        ) as server:
            server.url += "/test?sslmode=disable"  # (as the broker table writes it)
            yield server
    finally:
        shutil.rmtree(home, ignore_errors=True)


def private_redis(
    directory: Path, *, persistent: bool = False
) -> AbstractAsyncContextManager[PrivateServer]:
    """A redis-server of the test's own, without persistence (a restart loses all), or
    ``persistent``: every write in an append-only file before its reply."""
    command = _persistent_redis_command if persistent else _redis_command
    return _private(command, "redis", directory / "redis")


class _NodeExited(RuntimeError):
    """A node's process ended before it accepted a connection."""


class RedisClusterNodes:
    """A Redis Cluster of the tests' own on loopback: ``masters`` masters with
    ``replicas`` replicas each, every node a redis-server without persistence in its
    own session (only those are ever killed). Synchronous, so that a module-scoped
    fixture can start it once::

        with RedisClusterNodes(tmp_path) as cluster:
            RedisTransport(cluster.urls, cluster=True)
            cluster.kill(cluster.master_of("{prefix}"))  # its replica takes over
    """

    #: Seconds a cluster may take to cover every slot after it was created (or a
    #: node's loss, or its return).
    SETTLE_TIMEOUT = 30.0

    def __init__(self, directory: Path, *, masters: int = 3, replicas: int = 1) -> None:
        self.directory = directory
        self.masters = masters
        self.replicas = replicas
        self.ports = [free_port() for _ in range(masters * (1 + replicas))]
        self._bus_ports = {port: free_port() for port in self.ports}
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._cli = _binary("redis-cli")

    @property
    def urls(self) -> list[str]:
        """Every node's URL."""
        return [f"redis://127.0.0.1:{port}" for port in self.ports]

    def __enter__(self) -> RedisClusterNodes:
        try:
            for index in range(len(self.ports)):
                self._start_new_node(index)
            self._cli_call(
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            )
            self.wait_settled()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_new_node(self, index: int, attempts: int = 3) -> None:
        """Start the ``index``-th node before the cluster is made; one that exits at once
        (a port chosen free and taken before it bound it, by an outgoing connection of
        another test) is started again on fresh ports."""
        for attempt in range(1, attempts + 1):
            port = self.ports[index]
            try:
                self.start_node(port)
                return
            except _NodeExited:
                self.kill(port)
                if attempt == attempts:
                    raise
                del self._bus_ports[port]
                self.ports[index] = fresh = free_port()
                self._bus_ports[fresh] = free_port()

    def start_node(self, port: int) -> None:
        """Start (or start again, with its cluster state) the node on ``port``.

        :raises RuntimeError: when it does not accept connections in time (``_NodeExited``
            when its process ended first)."""
        folder = self.directory / f"redis-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            *_redis_command(port, folder),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-node-timeout", "1000", "--cluster-port", str(self._bus_ports[port])),
            # A replica syncs at once (not 5 s later), and takes over whatever the age
            # of its data: the tests measure what an asynchronous replica loses.
            *("--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0"),
        ]
        self._processes[port] = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                code = self._processes[port].poll()
                if code is not None:
                    raise _NodeExited(f"redis-server on {port} exited at start ({code})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {port} did not start") from None
                time.sleep(0.05)

    def kill(self, port: int) -> None:
        """``kill -9`` the node on ``port`` (only this cluster's process) and reap it."""
        process = self._processes.pop(port, None)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        """Kill every node."""
        for port in list(self._processes):
            self.kill(port)

    def _cli_call(self, *args: str, port: int | None = None) -> str:
        where = ["-p", str(port)] if port is not None else []
        done = subprocess.run(
            [self._cli, "-h", "127.0.0.1", *where, *args],
            capture_output=True,
            timeout=60,
            check=True,
        )
        return done.stdout.decode()

    def _alive(self) -> list[int]:
        return [port for port, process in self._processes.items() if process.poll() is None]

    def wait_settled(self, masters: int | None = None) -> None:
        """Wait until every live node says the cluster is ``ok`` and sees ``masters``
        masters (default: as many as it was made with) among the live nodes."""
        wanted = self.masters if masters is None else masters
        deadline = time.monotonic() + self.SETTLE_TIMEOUT
        while True:
            states = {port: self._cli_call("cluster", "info", port=port) for port in self._alive()}
            ok = all("cluster_state:ok" in text for text in states.values())
            if ok and len(self.live_masters()) == wanted and self._replicas_in_sync():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster did not settle: {states}")
            time.sleep(0.2)

    def _replicas_in_sync(self) -> bool:
        """Whether every live replica whose master lives has its replication link up."""
        alive = set(self._alive())
        masters = {fields[0]: fields for fields in self._nodes()}
        for fields in masters.values():
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            if "slave" not in fields[2] or port not in alive:
                continue
            master = masters.get(fields[3])
            master_port = int(master[1].split("@")[0].rsplit(":", 1)[1]) if master else None
            if master_port not in alive:
                continue  # its master is gone: nothing to be in sync with
            if "master_link_status:up" not in self._cli_call("info", "replication", port=port):
                return False
        return True

    def _nodes(self) -> list[list[str]]:
        port = self._alive()[0]
        return [line.split() for line in self._cli_call("cluster", "nodes", port=port).splitlines()]

    def live_masters(self) -> list[int]:
        """The ports of the live nodes that are masters (serving slots)."""
        alive = set(self._alive())
        found = []
        for fields in self._nodes():
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            serves_slots = len(fields) > 8
            if "master" in fields[2] and "fail" not in fields[2] and port in alive and serves_slots:
                found.append(port)
        return found

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        port = self._alive()[0]
        slot = int(self._cli_call("cluster", "keyslot", key, port=port).strip())
        for fields in self._nodes():
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for served in fields[8:]:
                if served.startswith("["):
                    continue  # a slot being migrated
                first, _, last = served.partition("-")
                if int(first) <= slot <= int(last or first):
                    return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        raise RuntimeError(f"no master serves slot {slot}")

    def replicas_of(self, master: int) -> list[int]:
        """The ports of the live replicas of the master on port ``master``."""
        alive = set(self._alive())
        nodes = self._nodes()
        ids = [fields[0] for fields in nodes if f":{master}@" in fields[1]]
        found = []
        for fields in nodes:
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            if "slave" in fields[2] and fields[3] in ids and port in alive:
                found.append(port)
        return found

    def pause(self, port: int) -> None:
        """Stop the node on ``port`` (``SIGSTOP``): connected, answering nothing."""
        os.killpg(self._processes[port].pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """Let a paused node go on (``SIGCONT``)."""
        os.killpg(self._processes[port].pid, signal.SIGCONT)


@asynccontextmanager
async def private_redis_replica(
    directory: Path, master: PrivateServer
) -> AsyncIterator[PrivateServer]:
    """A redis-server of the test's own replicating ``master`` (``--replicaof``), yielded
    once its replication link is up."""

    def command(port: int, folder: Path) -> list[str]:
        return [
            *_redis_command(port, folder),
            *("--replicaof", "127.0.0.1", str(master.port), "--repl-diskless-sync-delay", "0"),
        ]

    async with _private(command, "redis", directory / "redis-replica") as replica:
        cli = _binary("redis-cli")
        with anyio.fail_after(START_TIMEOUT):
            while True:
                done = await anyio.run_process(
                    [cli, "-p", str(replica.port), "info", "replication"]
                )
                if b"master_link_status:up" in done.stdout:
                    break
                await anyio.sleep(0.05)
        yield replica


def private_nats(
    directory: Path, *, jetstream: bool = True
) -> AbstractAsyncContextManager[PrivateServer]:
    """A nats-server of the test's own with JetStream (unless ``jetstream=False``), its
    store in ``directory`` and its HTTP monitoring on ``server.monitor_port``."""
    monitor = free_port()
    return _private(
        _nats_command_with(jetstream=jetstream, monitor=monitor),
        "nats",
        directory / "nats",
        monitor_port=monitor,
    )


def _nats_node_command(
    name: str, cluster_port: int, routes: list[int]
) -> Callable[[int, Path], list[str]]:
    def command(port: int, directory: Path) -> list[str]:
        return [
            *_nats_command(port, directory),
            *("-n", name, "--cluster_name", "asyncbus-test"),
            *("--cluster", f"nats://127.0.0.1:{cluster_port}"),
            *("--routes", ",".join(f"nats://127.0.0.1:{route}" for route in routes)),
        ]

    return command


@asynccontextmanager
async def private_nats_cluster(
    directory: Path, size: int = 3
) -> AsyncIterator[list[PrivateServer]]:
    """``size`` nats-servers of the test's own, one JetStream cluster (``n1``, ``n2``...),
    each with its store in ``directory``; yields them once every node accepts clients
    (JetStream elects its leaders a moment later: a client retries its first calls)."""
    _nats_command(0, directory)  # skips (or fails) now when the binary is missing
    cluster_ports = [free_port() for _ in range(size)]
    nodes = [
        PrivateServer(
            _nats_node_command(
                f"n{index + 1}",
                cluster_ports[index],
                [port for other, port in enumerate(cluster_ports) if other != index],
            ),
            "nats",
            directory / f"nats-n{index + 1}",
        )
        for index in range(size)
    ]
    try:
        async with anyio.create_task_group() as starting:
            for node in nodes:
                starting.start_soon(node.start)
        yield nodes
    finally:
        for node in nodes:
            await node.kill()


async def nats_connections(server: PrivateServer) -> int:
    """How many client connections the private nats-server has open (``/connz``)."""
    assert server.monitor_port is not None
    stream = await anyio.connect_tcp("127.0.0.1", server.monitor_port)
    async with stream:
        await stream.send(b"GET /connz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        with contextlib.suppress(anyio.EndOfStream):
            while True:
                reply += await stream.receive()
    count: int = json.loads(reply.partition(b"\r\n\r\n")[2])["num_connections"]
    return count


def private_rabbit(directory: Path) -> AbstractAsyncContextManager[PrivateServer]:
    """A RabbitMQ node of the test's own (guest/guest), its data in ``directory``."""
    node = f"asyncbus-test-{uuid.uuid4().hex[:8]}@localhost"
    return _private(
        _rabbit_command,
        "amqp",
        directory / "rabbit",
        env=_rabbit_env(node, free_port()),
        userinfo="guest:guest",
        start_timeout=60.0,
    )


_RABBITMQCTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
#: Seconds a rabbitmqctl call may take (each starts an Erlang VM: about 1 s).
_CTL_TIMEOUT = 60.0


def _rabbit_node_env(
    node: str, dist_port: int, epmd_port: int, cookie: str
) -> Callable[[int, Path], dict[str, str]]:
    """A clustered node's environment: :func:`_rabbit_env`, the cluster's epmd and
    cookie, one scheduler (the machine is small) and distribution on loopback only."""
    base = _rabbit_env(node, dist_port)

    def env(port: int, directory: Path) -> dict[str, str]:
        found = base(port, directory)
        cookie_file = directory / "home" / ".erlang.cookie"
        if not cookie_file.exists():
            cookie_file.write_text(cookie)
            cookie_file.chmod(0o400)
        return {
            **found,
            "ERL_EPMD_PORT": str(epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": (
                "+S 1:1 -kernel inet_dist_use_interface {127,0,0,1}"
            ),
        }

    return env


class RabbitCluster:
    """Three RabbitMQ nodes of the tests' own joined into one cluster on loopback.

    ``nodes[i]`` is a :class:`PrivateServer` (``kill()`` is ``kill -9``); :meth:`restart`
    starts a killed node again and waits until it is back in the cluster;
    :meth:`leader_of` names the node leading a quorum queue (``rabbitmqctl``).
    """

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.directory = directory
        tag = uuid.uuid4().hex[:8]
        self.names = [f"asyncbus-{tag}-{index + 1}@localhost" for index in range(size)]
        cookie = uuid.uuid4().hex.upper()
        self._epmd = PrivateServer(
            lambda port, _: [
                _binary("epmd", "/usr/bin/epmd"),
                *("-port", str(port), "-address", "127.0.0.1"),
            ],
            "epmd",
            directory / "epmd",
        )
        self.nodes = [
            PrivateServer(
                _rabbit_command,
                "amqp",
                directory / f"rabbit-{index + 1}",
                env=_rabbit_node_env(name, free_port(), self._epmd.port, cookie),
                userinfo="guest:guest",
                start_timeout=60.0,
            )
            for index, name in enumerate(self.names)
        ]

    @property
    def urls(self) -> list[str]:
        """Every node's AMQP URL, in the order of :attr:`nodes`."""
        return [node.url for node in self.nodes]

    async def ctl(self, index: int, *args: str) -> str:
        """Run ``rabbitmqctl`` against node ``index`` (with its environment); its output.

        :raises RuntimeError: when it fails.
        """
        node = self.nodes[index]
        assert node._env is not None
        env = node._env(node.port, node.directory)
        ctl_port = free_port()
        env["RABBITMQ_CTL_DIST_PORT_MIN"] = env["RABBITMQ_CTL_DIST_PORT_MAX"] = str(ctl_port)
        command = _RABBITMQCTL if os.path.exists(_RABBITMQCTL) else _binary("rabbitmqctl")
        with anyio.fail_after(_CTL_TIMEOUT):
            done = await anyio.run_process(
                [command, "-n", self.names[index], "-q", *args], env=env, check=False
            )
        if done.returncode:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {self.names[index]} failed "
                f"({done.returncode}): {done.stdout.decode()} {done.stderr.decode()}"
            )
        return done.stdout.decode()

    async def start(self) -> None:
        """Start every node, then join the second and the third to the first."""
        await self._epmd.start()
        async with anyio.create_task_group() as starting:
            for node in self.nodes:
                starting.start_soon(node.start)
        for index in range(1, len(self.nodes)):
            await self.ctl(index, "stop_app")
            await self.ctl(index, "join_cluster", self.names[0])
            await self.ctl(index, "start_app")
        await self.wait_running(len(self.nodes))

    async def wait_running(self, count: int, timeout: float = 60.0) -> None:
        """Wait until a live node counts ``count`` running nodes in the cluster."""
        with anyio.fail_after(timeout):
            while True:
                alive = next(i for i, node in enumerate(self.nodes) if node.running)
                status = await self.ctl(alive, "eval", "length(rabbit_nodes:all_running()).")
                if status.strip() == str(count):
                    return
                await anyio.sleep(0.2)

    async def restart(self, index: int) -> None:
        """Start node ``index`` again (killed before: it keeps its data) and wait until
        every node runs in the cluster again."""
        await self.nodes[index].start()
        await self.wait_running(len(self.nodes))

    async def leader_of(self, queue: str) -> int:
        """The index of the node leading the quorum queue ``queue`` now.

        :raises LookupError: when no live node lists it with a leader.
        """
        alive = next(i for i, node in enumerate(self.nodes) if node.running)
        for line in (await self.ctl(alive, "list_queues", "name", "leader")).splitlines():
            name, _, leader = line.rpartition("\t")
            if name == queue and leader in self.names:
                return self.names.index(leader)
        raise LookupError(f"no leader listed for {queue!r}")

    async def aclose(self) -> None:
        """Kill every node and the epmd (only the processes this cluster started)."""
        with anyio.CancelScope(shield=True):
            for node in self.nodes:
                await node.kill()
            await self._epmd.kill()


@asynccontextmanager
async def private_rabbit_cluster(directory: Path) -> AsyncIterator[RabbitCluster]:
    """Three RabbitMQ nodes of the test's own joined into one cluster (guest/guest):
    see :class:`RabbitCluster`."""
    _rabbit_command(0, directory)  # skips (or fails) now when the server is missing
    cluster = RabbitCluster(directory)
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.aclose()
