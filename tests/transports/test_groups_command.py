"""``python -m asyncbus groups``, run as an operator would, against each broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
from _brokers import BROKERS, make_transport  # type: ignore[import-not-found]
from _private_brokers import RedisClusterNodes  # type: ignore[import-not-found]

from asyncbus import Bus
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def _command(*arguments: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``python -m asyncbus groups ...``; its exit status, stdout and stderr."""
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-m", "asyncbus", "groups", *arguments],
            check=False,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def _renamed(kind: str, url: str, prefix: str) -> None:
    """Group ``old`` bound by a process that left, then two envelopes published for it
    (the handler now subscribes as ``new``, which is not running)."""
    old = Bus(transport=make_transport(kind, url, prefix))

    @old.subscribe("orders.*", group="old")
    async def handle(n: int) -> None:
        raise AssertionError("the old group's process is gone")

    async with old:
        await old.subscribed()
    async with Bus(transport=make_transport(kind, url, prefix)) as publisher:
        for n in range(2):
            assert (await publisher.publish("orders.created", n)).accepted == ("orders.*@old",)


def _without_time(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in item.items() if key != "last_active"} for item in listed]


async def test_the_command_lists_the_groups_then_deletes_one_with_its_backlog(
    kind: str, url: str, unique_prefix: str
) -> None:
    await _renamed(kind, url, unique_prefix)
    where = ["--url", url, "--prefix", BROKERS[kind].namespaced(unique_prefix)]

    code, out, err = await _command(*where, "--format", "json")
    assert (code, err) == (0, "")
    listed = json.loads(out)
    assert _without_time(listed) == [
        {
            "pattern": "orders.*",
            "group": "old",
            "name": "orders.*@old",
            "backlog": 2,
            "consumers": 0,
        }
    ]
    assert listed[0]["last_active"] is None or isinstance(listed[0]["last_active"], float)

    code, out, err = await _command(*where)
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert header.split() == ["PATTERN", "GROUP", "BACKLOG", "CONSUMERS", "LAST", "ACTIVE"]
    assert row.split()[:4] == ["orders.*", "old", "2", "0"]

    # Not on a terminal: the group named is deleted without a question.
    code, out, err = await _command("delete", "orders.*", "old", *where)
    assert (code, out, err) == (0, "deleted group 'old' on 'orders.*'\n", "")

    code, out, err = await _command(*where, "--format", "json")
    assert (code, json.loads(out)) == (0, [])
    code, out, err = await _command(*where)
    assert (code, out) == (0, f"no groups under prefix {where[-1]!r}\n")

    # Deleted everywhere: a publish reaches no group (a no_subscribers dead letter).
    async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
        assert (await publisher.publish("orders.created", 3)).accepted == ()

    code, out, err = await _command("delete", "orders.*@old", *where, "--yes")
    assert (code, out) == (1, "")
    assert "no group 'old' on 'orders.*'" in err


async def test_the_command_refuses_to_delete_a_group_a_worker_reads_unless_forced(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))

    @worker.subscribe("jobs", group="workers")
    async def work(n: int) -> None:
        pass

    where = ["--url", url, "--prefix", BROKERS[kind].namespaced(unique_prefix)]
    with anyio.fail_after(90):
        async with worker:
            await worker.subscribed()
            while True:  # (a NATS pull request may be between two pulls)
                code, out, _ = await _command(*where, "--format", "json")
                (info,) = json.loads(out)
                if info["consumers"]:
                    break
            assert (code, info["name"], info["consumers"]) == (0, "jobs@workers", 1)
            code, out, err = await _command("delete", "jobs", "workers", *where, "--yes")
            assert (code, out) == (2, "")
            assert "1 consumer(s)" in err and "--force" in err
            code, out, err = await _command("delete", "jobs@workers", *where, "--force")
            assert (code, out) == (0, "deleted group 'workers' on 'jobs'\n")


async def test_the_url_may_come_from_the_environment(redis_url: str, unique_prefix: str) -> None:
    code, out, err = await _command(
        "--prefix", unique_prefix, "--format", "json", env={"ASYNCBUS_URL": redis_url}
    )
    assert (code, json.loads(out), err) == (0, [], "")


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ((), "--url URL"),
        (("--url", "http://127.0.0.1:8000"), "no transport for"),
        (("delete", "orders", "--url", "redis://127.0.0.1:6379/0"), "PATTERN and GROUP"),
        (("delete", "a", "b", "c", "--url", "redis://127.0.0.1:6379/0"), "PATTERN and GROUP"),
        (("orders.*", "--url", "redis://127.0.0.1:6379/0"), "invalid choice"),
        (
            ("--url", "redis://127.0.0.1:6379,redis://127.0.0.1:6380"),
            "several URLs name the nodes of a Redis Cluster: pass --cluster",
        ),
        (("--cluster", "--url", "nats://127.0.0.1:4222"), "--cluster is for a Redis Cluster"),
        (
            ("--cluster", "--url", "amqp://guest:guest@127.0.0.1:5672/"),
            "--cluster is for a Redis Cluster",
        ),
        (
            ("--cluster", "--url", "redis://127.0.0.1:6379/1"),
            "a cluster node is redis://[[user]:password@]host[:port]",
        ),
    ],
)
async def test_the_command_refuses_bad_arguments_with_status_2(
    arguments: tuple[str, ...], said: str
) -> None:
    code, out, err = await _command(*arguments, env={"ASYNCBUS_URL": ""})
    assert (code, out) == (2, "")
    assert said in err


async def test_a_broker_out_of_reach_is_status_1() -> None:
    code, out, err = await _command("--url", "redis://127.0.0.1:1/0")
    assert (code, out) == (1, "")
    assert "cannot connect to Redis at redis://127.0.0.1:1/0" in err


@pytest.mark.parametrize(("answer", "code"), [("n", 2), ("y", 0)])
async def test_on_a_terminal_the_command_asks_before_deleting(
    redis_url: str, unique_prefix: str, answer: str, code: int
) -> None:
    import pty

    await _renamed("redis", redis_url, unique_prefix)
    where = ["--url", redis_url, "--prefix", unique_prefix]
    main, terminal = pty.openpty()
    try:
        os.write(main, f"{answer}\n".encode())
        with anyio.fail_after(60):
            done = await anyio.run_process(
                [sys.executable, "-m", "asyncbus", "groups", "delete", "orders.*", "old", *where],
                check=False,
                stdin=terminal,
            )
    finally:
        os.close(main)
        os.close(terminal)
    assert done.returncode == code
    assert done.stdout.decode().startswith(
        "Delete group 'old' on 'orders.*' and its backlog of 2? [y/N] "
    )
    _, out, _ = await _command(*where, "--format", "json")
    assert [group["name"] for group in json.loads(out)] == (["orders.*@old"] if code else [])


@pytest.mark.parametrize("kind", ["nats", "rabbit"], indirect=True)
async def test_the_command_takes_a_clusters_nodes_as_urls_separated_by_commas(
    kind: str, url: str, unique_prefix: str
) -> None:
    # The first node is down: the transport goes on to the next, as it does in a bus
    # (RabbitMQ's warns of the one that did not answer).
    dead = url.replace(f":{urlsplit(url).port}", ":1", 1)
    code, out, err = await _command(
        "--url", f"{dead},{url}", "--prefix", unique_prefix, "--format", "json"
    )
    assert (code, json.loads(out)) == (0, [])
    warned = [line for line in err.splitlines() if "('127.0.0.1', 1)" not in line]
    assert (warned, bool(err)) == ([], kind == "rabbit")


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A Redis Cluster of the test's own (about 3 s to start)."""
    pytest.importorskip("redis")
    with RedisClusterNodes(tmp_path) as nodes:
        yield nodes


@pytest.mark.cluster
async def test_the_command_lists_and_deletes_the_groups_of_a_redis_cluster(
    redis_cluster: RedisClusterNodes, unique_prefix: str
) -> None:
    def transport() -> RedisTransport:
        return RedisTransport(redis_cluster.urls, prefix=unique_prefix, cluster=True)

    old = Bus(transport=transport())

    @old.subscribe("orders.*", group="old")
    async def handle(n: int) -> None:
        raise AssertionError("the old group's process is gone")

    async with old:
        await old.subscribed()
    async with Bus(transport=transport()) as publisher:
        for n in range(2):
            assert (await publisher.publish("orders.created", n)).accepted == ("orders.*@old",)

    every_node = ["--cluster", "--url", ",".join(redis_cluster.urls), "--prefix", unique_prefix]
    code, out, err = await _command(*every_node, "--format", "json")
    assert (code, err) == (0, "")
    assert _without_time(json.loads(out)) == [
        {
            "pattern": "orders.*",
            "group": "old",
            "name": "orders.*@old",
            "backlog": 2,
            "consumers": 0,
        }
    ]
    # One node is enough: it tells the client the others.
    one_node = ["--cluster", "--url", redis_cluster.urls[-1], "--prefix", unique_prefix]
    code, out, err = await _command(*one_node)
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert (header.split()[0], row.split()[:4]) == ("PATTERN", ["orders.*", "old", "2", "0"])

    code, out, err = await _command("delete", "orders.*@old", *one_node)
    assert (code, out, err) == (0, "deleted group 'old' on 'orders.*'\n", "")
    code, out, err = await _command(*every_node, "--format", "json")
    assert (code, json.loads(out), err) == (0, [], "")

    # Without --cluster, several URLs are refused (the message names the flag).
    code, out, err = await _command("--url", ",".join(redis_cluster.urls))
    assert (code, out) == (2, "")
    assert "pass --cluster" in err
