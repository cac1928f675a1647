"""The Lua scripts of :class:`~asyncbus.transports.redis.RedisTransport`.

Each one does, atomically on the server, a step that would race if it took several
round trips: claiming with delivery counts, handing entries back, forgetting dead
consumers, moving due retries back.
"""

from __future__ import annotations

__all__ = [
    "ADD",
    "CLAIM",
    "CLEAR_DEAD",
    "COUNT_DELAYED",
    "GIVE_BACK",
    "MOVE_DUE",
    "MOVE_DUE_OF_BINDING",
    "PUBLISH",
    "REAP",
    "REAP_INBOXES",
    "RELEASE",
    "STALE_DEAD",
    "TAKE_DEAD",
    "TOUCH",
]

#: Lua: add ``delta`` to the count of delayed retries of ``stream`` in hash ``counts``;
#: a count that is not a whole number >= 0 (another client wrote it) counts as 0, and a
#: count that reaches 0 is removed. Shared by the scripts below.
_ADD_DELAYED = """
local function add_delayed(counts, stream, delta)
  local ok, found = pcall(redis.call, 'HGET', counts, stream)
  local n = ok and tonumber(found) or nil
  if n == nil or n ~= math.floor(n) or n < 0 or n > 2^53 then n = 0 end
  n = n + delta
  if n > 0 then
    redis.pcall('HSET', counts, stream, n)
  else
    redis.pcall('HDEL', counts, stream)
  end
end
"""

#: Count one more delayed retry of a stream. KEYS[1] the hash of counts; ARGV stream.
COUNT_DELAYED = (
    _ADD_DELAYED
    + """
add_delayed(KEYS[1], ARGV[1], 1)
return 1
"""
)

#: XADD a batch of publishes, routed by the bindings of a version, in one command (one
#: reply to parse instead of one per entry). KEYS[1] the version key, KEYS[2..] streams.
#: ARGV[1] the version the routes were made from ('' for none); then groups of
#: envelopes going to the same streams (one per publish, or one for consecutive
#: publishes to the same streams): the number of its streams, their indexes into KEYS
#: (negative for a request inbox: written only if it still exists, NOMKSTREAM), the
#: number of its envelopes, then (meta, body) for each envelope. A meta that is a JSON
#: array is not meta: the entry is written for clients that know nothing of asyncbus,
#: the array's (field, value, ...) pairs then ``body``.
#: Nothing is written when the version is another (a binding was added or deleted
#: since: the routes may name a stream that is gone). Returns {1 if written else 0,
#: the version}. ARGV[1] ``-`` (no version is ever that) checks no version: on a
#: cluster whose bindings spread over slots, KEYS[1] is then any key of the streams'
#: slot, not read (the publisher read the version before).
PUBLISH = """
local version = ''
if ARGV[1] ~= '-' then
  version = redis.call('GET', KEYS[1])
  if (version or '') ~= ARGV[1] then return {0, version or ''} end
end
local function add(key, head, meta, body)
  if string.sub(meta, 1, 1) == '[' then
    local fields = cjson.decode(meta)
    fields[#fields + 1] = 'body'
    fields[#fields + 1] = body
    if head == 'NOMKSTREAM' then
      return redis.call('XADD', key, 'NOMKSTREAM', '*', unpack(fields))
    end
    return redis.call('XADD', key, '*', unpack(fields))
  end
  if head == 'NOMKSTREAM' then
    return redis.call('XADD', key, 'NOMKSTREAM', '*', 'meta', meta, 'body', body)
  end
  return redis.call('XADD', key, '*', 'meta', meta, 'body', body)
end
local i = 2
while i <= #ARGV do
  local streams = tonumber(ARGV[i])
  local targets = {}
  for s = 1, streams do
    targets[s] = tonumber(ARGV[i + s])
  end
  i = i + streams + 1
  local envelopes = tonumber(ARGV[i])
  i = i + 1
  for at = i, i + envelopes * 2 - 1, 2 do
    for s = 1, streams do
      local k = targets[s]
      if k > 0 then
        add(KEYS[k], '', ARGV[at], ARGV[at + 1])
      else
        add(KEYS[-k], 'NOMKSTREAM', ARGV[at], ARGV[at + 1])
      end
    end
  end
  i = i + envelopes * 2
end
return {1, version or ''}
"""

#: XADD entries to one stream, in order. KEYS[1] the stream; ARGV meta, body, meta,
#: body... Returns how many were added.
ADD = """
for at = 1, #ARGV, 2 do
  redis.call('XADD', KEYS[1], '*', 'meta', ARGV[at], 'body', ARGV[at + 1])
end
return #ARGV / 2
"""

#: XAUTOCLAIM entries idle for ARGV[3] ms and report each one's delivery count.
#: KEYS[1] stream; ARGV group, consumer, min-idle ms, cursor, count.
#: Returns {next cursor, {{id, {field, value, ...}, times delivered}, ...}}.
CLAIM = """
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4],
                         'COUNT', ARGV[5])
local out = {}
for _, entry in ipairs(reply[2]) do
  if entry[2] then
    local pending = redis.call('XPENDING', KEYS[1], ARGV[1], entry[1], entry[1], 1)
    local count = 1
    if pending[1] then count = pending[1][4] end
    out[#out + 1] = {entry[1], entry[2], count}
  end
end
return {reply[1], out}
"""

#: Reset the idle time of the entries ARGV[3..] that consumer ARGV[2] still owns
#: (XCLAIM to itself, JUSTID: no delivery is counted); an entry another consumer took
#: meanwhile is left alone. KEYS[1] stream; ARGV group, consumer, ids. Returns how many.
TOUCH = """
local touched = 0
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] and pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    touched = touched + 1
  end
end
return touched
"""

#: Lua: hand the pending entry ``entry`` (an XPENDING row) to the sentinel consumer
#: ARGV[3], idle ARGV[4] ms (claimed at once by the group's next claim round), with its
#: delivery count put back: the hand-back is no delivery. KEYS[1] stream, ARGV[1] group.
_HAND_BACK = """
local function hand_back(entry)
  local count = entry[4] - 1
  if count < 0 then count = 0 end
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, entry[1],
             'IDLE', ARGV[4], 'RETRYCOUNT', count, 'JUSTID')
end
"""

#: Hand every entry a consumer holds back (see ``_HAND_BACK``), then delete the
#: consumer. KEYS[1] stream; ARGV group, consumer, sentinel, idle ms.
RELEASE = (
    _HAND_BACK
    + """
local released = 0
local start = '-'
while true do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', 100, ARGV[2])
  if #pending == 0 then break end
  for _, entry in ipairs(pending) do
    hand_back(entry)
    released = released + 1
  end
  start = '(' .. pending[#pending][1]
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return released
"""
)

#: Hand back the entries ARGV[5..] that consumer ARGV[2] still holds (see
#: ``_HAND_BACK``). KEYS[1] stream; ARGV group, consumer, sentinel, idle ms, ids.
GIVE_BACK = (
    _HAND_BACK
    + """
local given = 0
for i = 5, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if pending[1] then
    hand_back(pending[1])
    given = given + 1
  end
end
return given
"""
)

#: Delete consumers that hold nothing and were idle ARGV[2] ms (dead processes).
#: A consumer that reads again is re-created by XREADGROUP, so this is always safe.
#: KEYS[1] stream; ARGV group, min-idle ms.
REAP = """
local reaped = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['pending'] == 0 and info['idle'] >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    reaped = reaped + 1
  end
end
return reaped
"""

#: Move delayed retries that are due back to their streams; one whose binding is gone
#: (its group was deleted) is dropped, not written to a stream nobody reads.
#: KEYS[1] the sorted set of item keys by due time (ms), KEYS[2] the hash of counts
#: per stream, KEYS[3] the bindings hash; ARGV now ms, limit. Each item is a hash
#: (stream, meta, body).
#: Returns {moved, score of the next item or nil}.
MOVE_DUE = (
    _ADD_DELAYED
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, item in ipairs(due) do
  redis.call('ZREM', KEYS[1], item)
  local fields = redis.call('HMGET', item, 'stream', 'meta', 'body')
  if fields[1] then
    if redis.call('HEXISTS', KEYS[3], fields[1]) == 1 then
      redis.call('XADD', fields[1], '*', 'meta', fields[2], 'body', fields[3])
    end
    add_delayed(KEYS[2], fields[1], -1)
  end
  redis.call('DEL', item)
end
local after = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {#due, after[2]}
"""
)

#: Move the due delayed retries of one binding back to its stream (a cluster whose
#: bindings spread over slots keeps them with the binding). KEYS[1] the binding's sorted
#: set of item keys by due time (ms), KEYS[2] its stream; ARGV now ms, limit. An item
#: whose stream is gone (its group was deleted) is dropped. Returns {moved, score of
#: the next item or nil}.
MOVE_DUE_OF_BINDING = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local bound = redis.call('EXISTS', KEYS[2]) == 1
for _, item in ipairs(due) do
  redis.call('ZREM', KEYS[1], item)
  local fields = redis.call('HMGET', item, 'meta', 'body')
  if bound and fields[1] then
    redis.call('XADD', KEYS[2], '*', 'meta', fields[1], 'body', fields[2])
  end
  redis.call('DEL', item)
end
local after = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {#due, after[2]}
"""

#: Delete the request inboxes whose expiry passed (their process died): the stream,
#: its binding and its entry in the sorted set; then change the bindings' version.
#: KEYS[1] the sorted set of inbox streams by expiry (ms), KEYS[2] the bindings hash,
#: KEYS[3] the version key; ARGV now ms, a new version, and ``1`` to leave the streams
#: to the caller (on a cluster whose bindings spread over slots they are in other
#: slots). Returns the streams gone.
REAP_INBOXES = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, stream in ipairs(gone) do
  redis.call('ZREM', KEYS[1], stream)
  redis.call('HDEL', KEYS[2], stream)
  if ARGV[3] ~= '1' then redis.call('DEL', stream) end
end
if #gone > 0 then redis.call('SET', KEYS[3], ARGV[2]) end
return gone
"""

#: Take dead letters out of the dead-letter stream, each at most once however many
#: processes ask (the claim of a replay), and tell every watcher which went.
#: KEYS[1] the dead-letter stream, KEYS[2] the stream of removals, KEYS[3] the count of
#: removals; ARGV the removals' length to keep, then (entry id, its key as JSON, or ''
#: for an entry no watcher lists) pairs.
#: Returns the entry ids this call deleted; for them, one removal is added: ``n`` (the
#: count, so a watcher that missed one knows) and ``keys`` (a JSON list of their keys).
TAKE_DEAD = """
local taken = {}
local keys = {}
for i = 2, #ARGV, 2 do
  if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then
    taken[#taken + 1] = ARGV[i]
    if ARGV[i + 1] ~= '' then keys[#keys + 1] = ARGV[i + 1] end
  end
end
if #taken > 0 then
  local n = redis.call('INCR', KEYS[3])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*',
    'n', n, 'keys', '[' .. table.concat(keys, ',') .. ']')
end
return taken
"""

#: Delete every dead letter; tell every watcher to read the store again.
#: KEYS as for TAKE_DEAD; ARGV the removals' length to keep. Returns how many went.
CLEAR_DEAD = """
local gone = redis.call('XLEN', KEYS[1])
redis.call('DEL', KEYS[1])
local n = redis.call('INCR', KEYS[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'n', n, 'all', 1)
return gone
"""

#: Tell every watcher to read the dead letters again (entries were put back).
#: KEYS as for TAKE_DEAD; ARGV the removals' length to keep.
STALE_DEAD = """
local n = redis.call('INCR', KEYS[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'n', n, 'all', 1)
return n
"""
