"""Every SQL statement :class:`~asyncbus.transports.postgres.PostgresTransport` runs, for
one schema (see :mod:`._pg_schema` for the tables).

A statement that makes work available (a publish, a nack, a release) also notifies the
schema's channel with the group's id, and one that stores a dead letter the schema's
``_dead`` channel with its row, in the same statement: the notification goes out
when the statement's transaction commits (the caller's, for a publish given
``connection=``), never before the rows can be seen.

The statements of the shared stores (rate buckets, slots, heartbeats) read the
database's clock (``clock_timestamp()``, as epoch seconds), once the row they change is
locked, so every process agrees on time and a turn waited for in line is timed when
taken.
"""

from __future__ import annotations

from .._cluster import FORGET_AFTER

__all__ = ["Statements"]

#: The rows of a publish, numbered: ``unnest`` of (ids, metas, bodies, attempts).
_ROWS = (
    "unnest($2::text[], $3::bytea[], $4::bytea[], $5::int[]) "
    "WITH ORDINALITY AS e(id, meta, body, attempt, n)"
)

#: The database's clock, read when evaluated, as epoch seconds (``c.now``).
_CLOCK = "(SELECT extract(epoch FROM clock_timestamp())::float8 AS now) c"
#: The leases of slots row ``l`` that have not run out at ``c.now`` (``e.key``, ``e.value``;
#: a value that is not a number, written by another client, counts as run out).
_LIVE = """jsonb_each(l.leases) e
    WHERE CASE WHEN jsonb_typeof(e.value) = 'number' THEN e.value::float8 END > c.now"""


class Statements:
    """The SQL of one schema, formatted once (the schema name is a checked identifier,
    also the name of the channel consumers listen on)."""

    def __init__(self, schema: str) -> None:
        s = schema
        wake = f"pg_notify('{s}', group_id::text)"
        told = f"pg_notify('{s}_dead', '+' || seq)"
        #: (topic, ids, metas, bodies, attempts) -> the groups reached (pattern, grp).
        self.publish = f"""
            WITH g AS (SELECT id, pattern, grp FROM {s}.groups WHERE $1 ~ regex),
            ins AS (
                INSERT INTO {s}.messages (group_id, envelope_id, meta, body, attempt)
                SELECT g.id, e.id, e.meta, e.body, e.attempt FROM g CROSS JOIN {_ROWS}
                ORDER BY g.id, e.n
                RETURNING group_id
            ),
            woken AS (SELECT {wake} FROM (SELECT DISTINCT group_id FROM ins) d)
            SELECT pattern, grp FROM g WHERE (SELECT count(*) FROM woken) >= 0"""
        #: (group id, ids, metas, bodies, attempts).
        self.publish_to_group = f"""
            WITH ins AS (
                INSERT INTO {s}.messages (group_id, envelope_id, meta, body, attempt)
                SELECT $1, e.id, e.meta, e.body, e.attempt FROM {_ROWS} ORDER BY e.n
                RETURNING group_id
            )
            SELECT {wake} FROM (SELECT DISTINCT group_id FROM ins) d"""
        #: (pattern, grp, regex, alive until or NULL) -> the group's id.
        self.register = f"""
            INSERT INTO {s}.groups (pattern, grp, regex, alive_until) VALUES ($1, $2, $3, $4)
            ON CONFLICT (pattern, grp) DO UPDATE SET alive_until = CASE
                WHEN {s}.groups.alive_until IS NULL THEN NULL ELSE EXCLUDED.alive_until END
            RETURNING id"""
        #: (consumer, group id, alive until).
        self.join = f"""
            INSERT INTO {s}.consumers (id, group_id, alive_until) VALUES ($1, $2, $3)
            ON CONFLICT (id) DO UPDATE SET
                group_id = EXCLUDED.group_id, alive_until = EXCLUDED.alive_until"""
        #: (consumer).
        self.leave = f"DELETE FROM {s}.consumers WHERE id = $1"
        #: (live consumers, now, alive until): renew those and their groups' last
        #: activity, forget dead ones.
        self.keep_consumers = f"""
            WITH kept AS (
                UPDATE {s}.consumers SET alive_until = $3 WHERE id = ANY($1::text[])
                RETURNING group_id
            ),
            active AS (
                UPDATE {s}.groups SET last_active = $2 WHERE id IN (SELECT group_id FROM kept)
            )
            DELETE FROM {s}.consumers WHERE alive_until < $2 AND NOT (id = ANY($1::text[]))"""
        #: (group ids) -> those that still exist.
        self.existing_groups = f"SELECT id FROM {s}.groups WHERE id = ANY($1::int[])"
        #: (now) -> (pattern, grp, backlog, live consumers, last active) of each group but
        #: the request inboxes.
        self.groups = f"""
            SELECT g.pattern, g.grp,
                (SELECT count(*) FROM {s}.messages m WHERE m.group_id = g.id),
                (SELECT count(*) FROM {s}.consumers c
                    WHERE c.group_id = g.id AND c.alive_until >= $1),
                g.last_active
            FROM {s}.groups g WHERE g.alive_until IS NULL
            ORDER BY g.pattern, g.grp"""
        #: (pattern, grp) -> the id of the group deleted, with its rows (none: NULL).
        self.delete_group = f"DELETE FROM {s}.groups WHERE pattern = $1 AND grp = $2 RETURNING id"
        #: (group id) drops a request inbox and its rows.
        self.drop_group = f"DELETE FROM {s}.groups WHERE id = $1"
        #: (group id, consumer, ack timeout, most rows) -> (seq, meta, body, attempt,
        #: deliveries, queued_at) of each row claimed.
        self.claim = f"""
            UPDATE {s}.messages m SET
                claimed_by = $2,
                claimed_until = now() + make_interval(secs => $3),
                deliveries = m.deliveries + 1
            FROM (
                SELECT seq FROM {s}.messages
                WHERE group_id = $1 AND available_at <= now()
                    AND (claimed_until IS NULL OR claimed_until < now())
                ORDER BY seq LIMIT $4 FOR UPDATE SKIP LOCKED
            ) c
            WHERE m.seq = c.seq
            RETURNING m.seq, m.meta, m.body, m.attempt, m.deliveries, m.queued_at"""
        #: (seqs).
        self.ack_many = f"DELETE FROM {s}.messages WHERE seq = ANY($1::bigint[])"
        #: (seq, delay, consumer): the next attempt, available after the delay (only
        #: while the consumer holds the claim: one that lost it leaves the row alone).
        self.nack = f"""
            WITH u AS (
                UPDATE {s}.messages SET
                    claimed_by = NULL, claimed_until = NULL,
                    attempt = attempt + greatest(deliveries, 1), deliveries = 0,
                    available_at = now() + make_interval(secs => $2)
                WHERE seq = $1 AND claimed_by = $3
                RETURNING group_id
            )
            SELECT {wake} FROM u"""
        #: (seq, envelope id, dead at, entry, consumer): moved to the dead letters while
        #: the consumer holds the claim (one that lost it leaves the row to its holder).
        self.reject = f"""
            WITH d AS (
                DELETE FROM {s}.messages WHERE seq = $1 AND claimed_by = $5 RETURNING seq
            ),
            ins AS (
                INSERT INTO {s}.dead_letters (envelope_id, dead_at, entry)
                SELECT $2, $3, $4 WHERE EXISTS (SELECT 1 FROM d) RETURNING seq
            )
            SELECT {told} FROM ins"""
        #: (seqs, consumer, group id): given back uncounted, unless claimed by another.
        self.release = f"""
            WITH u AS (
                UPDATE {s}.messages SET
                    claimed_by = NULL, claimed_until = NULL,
                    deliveries = greatest(deliveries - 1, 0)
                WHERE seq = ANY($1::bigint[]) AND claimed_by = $2
                RETURNING group_id
            )
            SELECT pg_notify('{s}', $3::int::text) WHERE EXISTS (SELECT 1 FROM u)"""
        #: (consumers, ack timeout).
        self.renew = f"""
            UPDATE {s}.messages SET claimed_until = now() + make_interval(secs => $2)
            WHERE claimed_by = ANY($1::text[])"""
        #: (live inbox group ids, now, alive until): keep those, drop dead ones.
        self.keep_inboxes = f"""
            WITH kept AS (
                UPDATE {s}.groups SET alive_until = $3
                WHERE id = ANY($1::int[]) AND alive_until IS NOT NULL
            )
            DELETE FROM {s}.groups WHERE alive_until < $2 AND NOT (id = ANY($1::int[]))"""
        #: (pattern, grp) -> rows not settled.
        self.backlog = f"""
            SELECT count(*) FROM {s}.messages m JOIN {s}.groups g ON g.id = m.group_id
            WHERE g.pattern = $1 AND g.grp = $2"""
        #: (envelope id, dead at, entry): stored, and the watchers told.
        self.add_dead_letter = f"""
            WITH ins AS (
                INSERT INTO {s}.dead_letters (envelope_id, dead_at, entry)
                VALUES ($1, $2, $3) RETURNING seq
            )
            SELECT {told} FROM ins"""
        #: (envelope id, dead at, entry): stored again (the watchers are told apart).
        self.restore_dead_letter = (
            f"INSERT INTO {s}.dead_letters (envelope_id, dead_at, entry) VALUES ($1, $2, $3)"
        )
        #: (envelope ids) -> (seq, entry) of each removed.
        self.take_dead_letters = f"""
            DELETE FROM {s}.dead_letters WHERE envelope_id = ANY($1::text[])
            RETURNING seq, entry"""
        #: (what) tells the dead-letter watchers.
        self.tell = f"SELECT pg_notify('{s}_dead', $1)"
        #: () removes every dead letter and tells the watchers to read again.
        self.clear_dead_letters = f"""
            WITH d AS (DELETE FROM {s}.dead_letters) SELECT pg_notify('{s}_dead', '!')"""
        #: (seqs) -> entry of those still kept, oldest first.
        self.dead_letters_at = (
            f"SELECT entry FROM {s}.dead_letters WHERE seq = ANY($1::bigint[]) ORDER BY seq"
        )
        #: () -> entry, oldest first.
        self.dead_letters = f"SELECT entry FROM {s}.dead_letters ORDER BY seq"
        #: (dead before, most kept).
        self.prune_dead_letters = f"""
            DELETE FROM {s}.dead_letters WHERE dead_at < $1 OR seq <= (
                SELECT seq FROM {s}.dead_letters ORDER BY seq DESC OFFSET $2 LIMIT 1)"""
        #: (key, owner, lease) -> 'claimed', 'done' or 'busy'.
        self.claim_key = f"""
            WITH c AS (
                INSERT INTO {s}.claims (key, owner, until)
                VALUES ($1, $2, now() + make_interval(secs => $3))
                ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, until = EXCLUDED.until
                WHERE {s}.claims.until < now()
                RETURNING 1
            )
            SELECT CASE
                WHEN EXISTS (SELECT 1 FROM c) THEN 'claimed'
                WHEN (SELECT owner FROM {s}.claims WHERE key = $1) = '' THEN 'done'
                ELSE 'busy' END"""
        #: (key, owner, lease) -> 'UPDATE n'.
        self.extend_key = f"""
            UPDATE {s}.claims SET until = now() + make_interval(secs => $3)
            WHERE key = $1 AND owner = $2 AND until >= now()"""
        #: (key, ttl).
        self.done_key = f"""
            INSERT INTO {s}.claims (key, owner, until)
            VALUES ($1, '', now() + make_interval(secs => $2))
            ON CONFLICT (key) DO UPDATE SET owner = '', until = EXCLUDED.until"""
        #: (key, owner).
        self.release_key = f"DELETE FROM {s}.claims WHERE key = $1 AND owner = $2"
        #: () drops expired claims, full rate buckets, slots without a live lease and the
        #: heartbeats of processes long gone.
        self.prune = f"""
            WITH claims AS (DELETE FROM {s}.claims WHERE until < now()),
            rates AS (
                DELETE FROM {s}.rates WHERE full_at < extract(epoch FROM clock_timestamp())
            ),
            slots AS (
                DELETE FROM {s}.slots l WHERE NOT EXISTS (SELECT 1 FROM {_CLOCK}, {_LIVE})
            )
            DELETE FROM {s}.heartbeats
            WHERE seen < clock_timestamp() - make_interval(secs => {FORGET_AFTER})"""
        #: (bucket, interval, burst) -> seconds until the turn it takes is due. A TAT that
        #: is not finite (another client's) counts as a new bucket.
        self.take_turn = f"""
            INSERT INTO {s}.rates AS r (bucket, tat, asked_at, full_at)
            SELECT $1::text, c.now - ($3::bigint - 1) * $2::float8 + $2, c.now, c.now + $2
            FROM {_CLOCK}
            ON CONFLICT (bucket) DO UPDATE SET (tat, asked_at, full_at) = (
                SELECT t.turn + $2, c.now, t.turn + $3 * $2
                FROM {_CLOCK}, LATERAL (SELECT CASE WHEN r.tat < 'Infinity'
                    THEN greatest(r.tat, c.now - ($3 - 1) * $2)
                    ELSE c.now - ($3 - 1) * $2 END AS turn) t
            )
            RETURNING greatest(0, r.tat - $2 - r.asked_at)"""
        #: (name, limit, holder, lease) -> whether the holder has a slot now (no row: every
        #: slot is held by others, and the row is left as it is, not written again).
        self.acquire_slot = f"""
            INSERT INTO {s}.slots AS l (name, leases)
            SELECT $1::text, jsonb_build_object($3::text, c.now + $4::float8)
            FROM {_CLOCK} WHERE $2::bigint >= 1
            ON CONFLICT (name) DO UPDATE SET leases = (
                SELECT CASE WHEN h.leases ? $3 OR h.count < $2
                    THEN h.leases || jsonb_build_object($3, c.now + $4) ELSE h.leases END
                FROM {_CLOCK}, LATERAL (
                    SELECT coalesce(jsonb_object_agg(e.key, e.value), '{{}}') AS leases,
                        count(*) AS count
                    FROM {_LIVE}
                ) h
            )
            WHERE EXISTS (SELECT 1 FROM {_CLOCK}, {_LIVE} AND e.key = $3)
                OR (SELECT count(*) FROM {_CLOCK}, {_LIVE}) < $2
            RETURNING l.leases ? $3"""
        #: (name, holders, lease) -> how many of the holders still had a slot (renewed).
        self.renew_slots = f"""
            UPDATE {s}.slots l SET leases = (
                SELECT coalesce(jsonb_object_agg(e.key, CASE WHEN e.key = ANY($2::text[])
                    THEN to_jsonb(c.now + $3::float8) ELSE e.value END), '{{}}')
                FROM {_CLOCK}, {_LIVE}
            )
            WHERE name = $1::text
            RETURNING (SELECT count(*) FROM jsonb_object_keys(l.leases) k WHERE k = ANY($2))"""
        #: (name) -> how many of its leases have not run out.
        self.count_slots = f"""
            SELECT count(*) FROM {s}.slots l, {_CLOCK}, {_LIVE} AND l.name = $1::text"""
        #: (name, holder).
        self.release_slot = f"""
            UPDATE {s}.slots SET leases = leases - $2::text WHERE name = $1 AND leases ? $2"""
        #: (instance, record): its heartbeat, written now.
        self.beat = f"""
            INSERT INTO {s}.heartbeats (instance, record, seen)
            VALUES ($1, $2, clock_timestamp())
            ON CONFLICT (instance) DO UPDATE SET record = EXCLUDED.record, seen = EXCLUDED.seen"""
        #: () -> record of every process heard from within FORGET_AFTER.
        self.beats = f"""
            SELECT record FROM {s}.heartbeats
            WHERE seen >= clock_timestamp() - make_interval(secs => {FORGET_AFTER})
            ORDER BY instance"""
        #: (instance).
        self.forget_beat = f"DELETE FROM {s}.heartbeats WHERE instance = $1"
