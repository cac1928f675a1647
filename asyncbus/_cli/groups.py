"""``python -m asyncbus groups``: list the groups a broker keeps, or delete one.

It talks to the broker alone (no bus, no application imported): the transport is made
from the URL's scheme (``redis://``, ``rediss://``, ``unix://``: Redis; ``nats://``,
``tls://``: NATS; ``amqp://``, ``amqps://``: RabbitMQ), the prefix and, for a Redis
Cluster, ``--cluster``, and used through its :class:`~asyncbus.transports.GroupAdmin`
side. Several URLs, separated by commas, name the nodes of a cluster, as the transports
take them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from urllib.parse import urlsplit

from .._exceptions import ConfigurationError, ConnectError, TransportError
from .._groups import GroupInfo, delete_group, group_document, list_groups
from .._routing import compile_pattern
from ..transports._kit import redact
from ..transports._registry import TRANSPORTS, by_scheme
from ..transports.base import GroupAdmin, Transport
from . import Command

__all__ = ["COMMAND", "transport_for"]

#: Where the URL comes from when ``--url`` is not given.
URL_VARIABLE = "ASYNCBUS_URL"

_DESCRIPTION = """\
List the groups bound under a prefix of a broker (every process's), with their backlog
(envelopes not settled), their consumers and when one was last active; or delete one
group and its backlog.

A group outlives its code: the default group is the handler's module:qualname, so a
handler renamed leaves its old group bound, still given every matching publish. Delete
such a group once nothing reads it (a process still subscribed binds it again).

delete takes the group's pattern and name (two arguments, or one "pattern@group", the
stage name as receipts and the JSON listing say it). On a terminal it asks first (not
with --yes); run from a script it deletes the group it is named.

Exit status: 0 done; 1 the broker failed or the group to delete does not exist;
2 bad arguments, or a deletion refused (consumers read the group and no --force, or the
question on the terminal was not answered yes)."""

_EPILOG = """\
examples:
  python -m asyncbus groups --url redis://127.0.0.1:6379/0
  python -m asyncbus groups --url nats://127.0.0.1:4222 --prefix shop --format json
  python -m asyncbus groups --cluster --url redis://10.0.0.1:6379,redis://10.0.0.2:6379
  python -m asyncbus groups delete 'orders.*' app.handlers:old_name \\
      --url amqp://guest:guest@127.0.0.1:5672/
  python -m asyncbus groups delete 'orders.*@app.handlers:old_name' --url ... --yes"""


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "action",
        nargs="?",
        choices=("list", "delete"),
        default="list",
        help="list the groups (the default), or delete PATTERN GROUP",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="PATTERN GROUP",
        help="with delete: the group's pattern and name (or one pattern@group)",
    )
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_VARIABLE),
        help="the broker: redis://, rediss://, unix://, nats://, tls://, amqp:// or amqps://; "
        f"a cluster's nodes separated by commas (default: ${URL_VARIABLE})",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the URL names a Redis Cluster: one node or several, separated by commas "
        "(any that answers tells the rest). Redis only: a NATS or RabbitMQ cluster is "
        "its nodes' URLs alone",
    )
    parser.add_argument(
        "--prefix",
        default="asyncbus",
        help="the transports' prefix (PostgreSQL: the schema; default: %(default)s)",
    )
    parser.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="how to list them (default: %(default)s)",
    )
    parser.add_argument(
        "--yes", "-y", action="store_true", help="delete without asking on a terminal"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="delete even while consumers read the group (they bind it again: stop them first)",
    )


def transport_for(url: str, prefix: str, *, cluster: bool = False) -> Transport:
    """The transport a URL's scheme names (the first URL's, of several separated by
    commas), under ``prefix``.

    :param cluster: the URL names a cluster the transport speaks to as one
        (``cluster=True``: a Redis Cluster).
    :raises ConfigurationError: for a scheme no transport takes, ``cluster`` for a
        transport that takes no such thing, or a bad URL or prefix.
    """
    row = by_scheme(urlsplit(url.split(",", 1)[0].strip()).scheme)
    if row is None:
        every = ", ".join(f"{scheme}://" for each in TRANSPORTS for scheme in each.schemes)
        raise ConfigurationError(
            f"no transport for {redact(url)!r}: the URL must begin with one of {every}"
        )
    named = {row.namespace: prefix}
    if not cluster:
        transport = row.load()(url, **named)
    elif row.cluster:
        transport = row.load()(url, **named, cluster=True)
    else:
        raise ConfigurationError(
            f"--cluster is for a Redis Cluster; the {row.name} transport takes a "
            "cluster's nodes as its URLs alone, separated by commas (leave --cluster out)"
        )
    assert isinstance(transport, Transport)
    return transport


def _when(moment: float | None) -> str:
    if moment is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(moment))


def _table(groups: list[GroupInfo]) -> str:
    head = ("PATTERN", "GROUP", "BACKLOG", "CONSUMERS", "LAST ACTIVE")
    rows = [head] + [
        (i.pattern, i.group, str(i.backlog), str(i.consumers), _when(i.last_active)) for i in groups
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(head))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if 2 <= column <= 3 else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _split(name: str) -> list[str]:
    """``"pattern@group"`` as ``[pattern, group]``: at the first ``@`` after a valid
    pattern (either may hold ``@``); ``[name]`` when there is none."""
    at = name.find("@")
    while at > 0:
        pattern, group = name[:at], name[at + 1 :]
        if group:
            try:
                compile_pattern(pattern)
            except ConfigurationError:
                pass
            else:
                return [pattern, group]
        at = name.find("@", at + 1)
    return [name]


def _fail(message: str, code: int) -> int:
    print(f"python -m asyncbus groups: {message}", file=sys.stderr)
    return code


def _confirm(pattern: str, group: str, groups: list[GroupInfo]) -> bool:
    """Ask on the terminal (``True`` without one: the group was named exactly)."""
    if not sys.stdin.isatty():
        return True
    found = [info for info in groups if (info.pattern, info.group) == (pattern, group)]
    backlog = f" and its backlog of {found[0].backlog}" if found else ""
    answer = input(f"Delete group {group!r} on {pattern!r}{backlog}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


async def _run(arguments: argparse.Namespace) -> int:
    try:
        transport = transport_for(arguments.url, arguments.prefix, cluster=arguments.cluster)
    except ConfigurationError as error:  # named as the command line names it
        raise ConfigurationError(str(error).replace("cluster=True", "--cluster")) from error
    if not isinstance(transport, GroupAdmin):  # (every broker transport is one)
        return _fail(f"the {transport.name} transport cannot list groups", 2)
    async with transport:
        groups = list_groups(await transport.groups(), ())  # (the bus's own left out)
        if arguments.action == "list":
            if arguments.format == "json":
                print(json.dumps([group_document(info) for info in groups], indent=2))
            elif groups:
                print(_table(groups))
            else:
                print(f"no groups under prefix {arguments.prefix!r}")
            return 0
        pattern, group = arguments.names
        if not arguments.yes and not _confirm(pattern, group, groups):
            return _fail("not deleted (--yes deletes without asking)", 2)
        try:
            existed = await delete_group(
                transport, pattern, group, force=arguments.force, mine=False
            )
        except ConfigurationError as error:
            return _fail(str(error).replace("force=True", "--force"), 2)
        if not existed:
            return _fail(f"no group {group!r} on {pattern!r} under prefix {arguments.prefix!r}", 1)
        print(f"deleted group {group!r} on {pattern!r}")
        return 0


def _main(arguments: argparse.Namespace, rest: list[str]) -> int:
    if not arguments.url:
        return _fail(f"give the broker's URL: --url URL (or set ${URL_VARIABLE})", 2)
    if arguments.action == "delete" and len(arguments.names) == 1:
        arguments.names = _split(arguments.names[0])
    if arguments.action == "delete" and len(arguments.names) != 2:
        return _fail("delete takes the group's PATTERN and GROUP (or one pattern@group)", 2)
    if arguments.action == "list" and arguments.names:
        return _fail(f"unexpected arguments: {' '.join(arguments.names)}", 2)
    import anyio

    try:
        return anyio.run(_run, arguments, backend="asyncio")
    except ConfigurationError as error:
        return _fail(str(error), 2)
    except (ConnectError, TransportError, OSError) as error:
        return _fail(str(error), 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 1)


COMMAND = Command(
    help="list the groups bound in a broker (backlog, consumers), or delete one",
    configure=_configure,
    run=_main,
)
