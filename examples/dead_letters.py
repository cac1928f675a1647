"""Failures -> dead letters -> inspect -> replay.

Nothing a bus gives up on disappears: it lands in ``bus.dead_letters`` with the
reason, the stage, the error and the number of attempts, and is announced on the
``$deadletter`` topic. Once the cause is fixed, ``replay`` sends an entry back to the
stage that gave up on it (attempt count reset); ``purge`` drops what should not come
back.

The bus also logs each dead letter (a WARNING on the ``asyncbus.dead_letters``
logger, with the handler's traceback when it raised); here those records go to
stdout, one line each, beside what the script prints.

Run it:

    python examples/dead_letters.py
"""

import logging
import sys

import asyncbus
from asyncbus import DEADLETTER_TOPIC, Bus, DeadLetter, DeadLetterReason, Reject, Retry

bus = Bus()
gateway_up = False  # the payment gateway is down when the script starts
charged: list[int] = []
alerts: list[str] = []


@bus.subscribe("payments.requested", group="charger", retry=Retry(max_attempts=3, backoff=0.01))
async def charge(payment: dict) -> None:
    """Charge a card: retried 3 times, then dead-lettered while the gateway is down."""
    if payment["amount"] <= 0:
        raise Reject(f"amount must be positive, got {payment['amount']}")  # no retry
    if not gateway_up:
        raise ConnectionError("payment gateway unreachable")
    charged.append(payment["order"])


@bus.subscribe(DEADLETTER_TOPIC, group="alerts")
async def alert(dead: DeadLetter) -> None:
    """Every new dead letter is also published on ``$deadletter``: page someone."""
    alerts.append(f"{dead.reason}: {dead.envelope.topic}")


class OneLine(logging.Formatter):
    """A record on one line: the traceback is in ``bus.dead_letters`` already."""

    def formatException(self, exc_info: object) -> str:
        return ""


async def main() -> None:
    global gateway_up
    async with bus:
        for order, amount in [(1, 25), (2, 40), (3, -5)]:
            await bus.publish("payments.requested", {"order": order, "amount": amount})
        await bus.publish("refunds.requested", {"order": 1})  # nobody handles refunds yet
        await bus.drain(timeout=10)

        print(f"{len(bus.dead_letters)} dead letters, {len(alerts)} alerts raised:")
        for dead in bus.dead_letters.list():
            error = dead.error or "-"  # "Type: message", None when no exception happened
            print(f"  {dead.envelope.id}  {dead.reason:<15} stage={dead.stage}  "
                  f"attempts={dead.attempts}  error={error}")

        # Inspect by reason: the gateway outage is worth a replay, the bad amount and
        # the unhandled refund are not.
        failed = bus.dead_letters.list(reason=DeadLetterReason.HANDLER_FAILED)
        gateway_up = True  # ... the gateway is back
        await bus.dead_letters.replay(*(dead.envelope.id for dead in failed))
        await bus.drain(timeout=10)
        print(f"replayed {len(failed)} dead letters: orders {sorted(charged)} charged")

        left = sorted(f"{dead.reason} ({dead.envelope.topic})" for dead in bus.dead_letters.list())
        print("left in the queue: " + ", ".join(left))
        purged = bus.dead_letters.purge()
        print(f"purged {purged}; the queue is empty: {len(bus.dead_letters) == 0}")

        stage = bus.statistics().stage("payments.requested@charger")
        print(f"ledger of {stage.name}: published {stage.published} = acked {stage.acked} "
              f"+ dead-lettered {stage.dead_lettered} (retried {stage.retried})")

    assert sorted(charged) == [1, 2]


if __name__ == "__main__":
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(OneLine("log: %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("asyncbus").addHandler(handler)
    asyncbus.run(main)
