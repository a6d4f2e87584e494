-- Shared prelude of every queue script (prepended to each one by qps.transport).
--
-- KEYS[1] is the queue's meta hash; its other keys are derived from the same prefix (one
-- hash tag, one slot): items (a list; a hash slot->element for shuffle queues; a sorted
-- set of '<priority key><seq><element>' members, all with score 0, for priority queues), ew
-- (pending enqueue attempts), dw (pending dequeue attempts), lease (zset).
-- ARGV[1] holds the small arguments as space-separated tokens (A[1] is always the lease
-- length in ms; the rest is per script); ARGV[2..] carry payloads. Few arguments keep
-- the client's command packing cheap.
--
-- Attempt entries (members of ew/dw and of the lease zset):
--   'e|<id>'            an enqueue still inserting; its elements wait in a:<id>:p
--   'c|<id>'            a close() queued behind earlier enqueues
--   'd|<n>|<mode>|<id>' a dequeue of n elements (mode one|many|upto, with a final 'A'
--                       for an acknowledged dequeue: oneA|manyA|uptoA); holds a:<id>:h
--   'r|<id>'            a finished dequeue whose caller has not collected a:<id>:h yet,
--                       or (acknowledged dequeues) has not acked it yet
-- A finished attempt gets its outcome in a:<id>:s and a token in a:<id>:w (its caller
-- blocks on that list). All of these keys share the queue's hash tag, hence its slot.

local META = KEYS[1]
local P = string.sub(META, 1, -5)
local ITEMS, EW, DW, LEASE = P .. 'items', P .. 'ew', P .. 'dw', P .. 'lease'
local A = {}
for w in string.gmatch(ARGV[1], '%S+') do A[#A + 1] = w end
local LEASE_MS = tonumber(A[1])
local RECORD_MS = 60000
local BATCH = 500

-- Every meta field a script reads is checked here (the values are read anyway): a field
-- that is not what qps writes refuses the call with an error reply 'DATALOSS <key>: <why>'
-- (qps.queues.state turns it into a DataLossError) before anything is written, rather
-- than a wrong size, a queue that looks full or empty, or a generator stuck at 0.
local MAXN = 9007199254740991  -- 2^53 - 1: the integers a double holds exactly
local function corrupt(key, why)
  return redis.error_reply('DATALOSS ' .. key .. ': ' .. why)
end
-- A count field: false (missing) counts 0; nil for anything but an integer in [lo, hi].
local function field_int(v, lo, hi)
  if not v then return 0 end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) or n < lo or n > (hi or MAXN) then return nil end
  return n
end
local M = redis.pcall('HMGET', META, 'kind', 'cap', 'min', 'closed', 'w', 'n', 'enq', 'deq',
  'rng', 'seq', 'x')
if M.err then return corrupt(META, 'is not a hash') end
local KIND = M[1]
local S = {}
if KIND then
  if not (KIND == 'fifo' or KIND == 'padding' or KIND == 'shuffle' or KIND == 'priority') then
    return corrupt(META, "field 'kind' is not a queue type")
  end
  if not M[2] or not field_int(M[2], -1) then return corrupt(META, "field 'cap' is not a capacity") end
  if not (M[4] == '0' or M[4] == '1') then return corrupt(META, "field 'closed' is not 0 or 1") end
  local names = {[3] = 'min', [5] = 'w', [6] = 'n', [7] = 'enq', [8] = 'deq', [10] = 'seq',
                 [11] = 'x'}
  for i, name in pairs(names) do
    if not field_int(M[i], 0) then
      return corrupt(META, "field '" .. name .. "' is not a count in [0, 2^53-1]")
    end
  end
  if M[9] and not field_int(M[9], 1, 2147483646) then
    return corrupt(META, "field 'rng' is not a generator state in [1, 2^31-2]")
  end
  if KIND == 'shuffle' then
    local stored = redis.pcall('HLEN', P .. 'items')
    if type(stored) ~= 'number' then return corrupt(P .. 'items', 'is not a hash') end
    if stored ~= field_int(M[6], 0) then
      return corrupt(META, "field 'n' is " .. tostring(M[6]) .. ' but the items hash holds ' .. stored)
    end
  end
elseif redis.call('EXISTS', META) == 1 then
  return corrupt(META, "field 'kind' is missing")
end
local CAP = tonumber(M[2]) or -1
local MINAFTER = tonumber(M[3]) or 0
local CLOSED = (M[4] == '1')
local SHUFFLE = (KIND == 'shuffle')
local PRIO = (KIND == 'priority')
local LIST = not (SHUFFLE or PRIO)
-- A priority queue's element starts with an 8-byte order-preserving priority key and 16
-- bytes of sequence number: the client sends PLACEHOLDER there and the first insert
-- stamps it, so equal priorities leave in insertion order (ZPOPMIN of equal scores is
-- lexicographic). Other kinds store the element as sent (OFF 0).
local OFF = PRIO and 24 or 0
local PLACEHOLDER = string.rep('-', 16)
-- The meta fields a script changes are kept here and written back once, by commit(),
-- which the wrapper around every script body calls before returning:
--   n: stored elements of a shuffle queue;
--   x: a list queue's elements beyond one per entry of items: its size is LLEN items +
--      x (a batch entry 'QB|...' of c rows adds c - 1), which stays right even when
--      another client writes plain values to the list directly;
--   enq/deq: totals inserted/delivered; rng: shuffle generator state;
--   seq: the last sequence number a priority queue stamped;
--   w: entries in the lease zset (only lease_add/lease_del change its membership). Every
--      ew/dw entry has a lease, so w == 0 means nothing is pending, and the fast paths
--      skip reaping and flushing without a call.
S = {closed = CLOSED and 1 or 0, w = tonumber(M[5]) or 0, n = tonumber(M[6]) or 0,
     enq = tonumber(M[7]) or 0, deq = tonumber(M[8]) or 0, rng = tonumber(M[9]) or 1,
     seq = tonumber(M[10]) or 0, x = tonumber(M[11]) or 0}
local S0 = {}
for k, v in pairs(S) do S0[k] = v end

local function commit()
  if not KIND then return end
  local args = {}
  for k, v in pairs(S) do
    if v ~= S0[k] then
      args[#args + 1] = k
      args[#args + 1] = v
    end
  end
  if #args > 0 then redis.call('HSET', META, unpack(args)) end
end

local function set_closed()
  CLOSED = true
  S.closed = 1
end

local NOW_MS = nil
local function now()
  if not NOW_MS then
    local t = redis.call('TIME')
    NOW_MS = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW_MS
end

local function lease_add(e)
  S.w = S.w + redis.call('ZADD', LEASE, now() + LEASE_MS, e)
end

local function lease_del(...)
  if S.w == 0 then return 0 end
  local n = redis.call('ZREM', LEASE, ...)
  S.w = S.w - n
  return n
end

local function akey(id, suffix)
  return P .. 'a:' .. id .. ':' .. suffix
end

local function rpush_all(key, vals)
  for i = 1, #vals, BATCH do
    redis.call('RPUSH', key, unpack(vals, i, math.min(i + BATCH - 1, #vals)))
  end
end

-- Elements larger than a chunk are stored out of line in b:<bid>:<k> keys and queued as a
-- reference 'QR|<bid>|<nchunks>|<bytes>' (after the OFF bytes of a priority key). Chunks of stored, pending or held elements never
-- expire; chunks of delivered elements expire unless their consumer deletes them first
-- (it does, at once), so a consumer dying in between leaks nothing.
--
-- The rows of a large enqueue_many batch share one buffer b:<bid>. A list queue (FIFO,
-- padding) holds one entry for a run of consecutive rows, 'QB|<bid>|<first row>|<rows>|
-- <row bytes>' (it stands for <rows> elements: see x above, ecount and pop_elems, which
-- splits an entry when only some of its rows leave); a shuffle or priority queue holds a
-- reference 'QS|<bid>|<row>|<row bytes>' per row. b:<bid>:u counts the rows no consumer
-- has read yet: consumers read their rows with GETRANGE and then run the release script,
-- which deletes the buffer when the count reaches 0. Rows dropped before they were
-- stored (closed queue, cancelled enqueue) are released here (qs_drop). The producer
-- writes both keys with a TTL; storing a row persists them.
local CHUNK_TTL_MS = 600000
local MAX_CHUNKS = 2048  -- a message's most bytes (2^31 - 1) in chunks of 1 MiB
local Q, R, SB, BB = string.byte('QRSB', 1, 4)
local BAR = 124  -- '|'
local sbyte, sfind = string.byte, string.find

-- Whether v is a batch entry 'QB|...' (never behind a priority key: lists only).
local function is_qb(v)
  local b1, b2, b3 = sbyte(v, 1, 3)
  return b1 == Q and b2 == BB and b3 == BAR
end

local function qb_parse(v)
  local bid, first, rows, size = string.match(v, '^QB|([^|]+)|(%d+)|(%d+)|(%d+)$')
  if not bid then return nil end
  rows = tonumber(rows)
  if rows < 1 or tonumber(size) < 1 then return nil end  -- not an entry: one plain value
  return bid, tonumber(first), rows, size
end

-- The number of elements entry v stands for.
local function ecount(v)
  if is_qb(v) then
    local _, _, rows = qb_parse(v)
    if rows then return rows end
  end
  return 1
end

-- The number of elements a list of entries stands for.
local function nelems(vals)
  local n = #vals
  for _, v in ipairs(vals) do
    if is_qb(v) then n = n + ecount(v) - 1 end
  end
  return n
end

-- A batch entry cut after its first k rows: the entries for those rows and for the rest.
local function qb_split(v, k)
  local bid, first, rows, size = qb_parse(v)
  return string.format('QB|%s|%d|%d|%s', bid, first, k, size),
         string.format('QB|%s|%d|%d|%s', bid, first + k, rows - k, size)
end

-- vals cut after their first k elements (a batch entry split if it straddles the cut).
local function split_elems(vals, k)
  local head, rest, have = {}, {}, 0
  for i, v in ipairs(vals) do
    if have >= k then
      rest[#rest + 1] = v
    else
      local c = ecount(v)
      if have + c <= k then
        head[#head + 1] = v
      else
        local a, b = qb_split(v, k - have)
        head[#head + 1] = a
        rest[#rest + 1] = b
      end
      have = have + c
    end
  end
  return head, rest
end

-- Remove entries standing for k elements (or all there are, if fewer) from the front
-- of list key, splitting a batch entry that straddles the cut. Returns the entries, the
-- elements they stand for and the change in the list's x (elements beyond one per entry).
local function pop_elems(key, k)
  if k <= 0 then return {}, 0, 0 end
  local got = redis.call('LRANGE', key, 0, k - 1)
  local out, have, dx = {}, 0, 0
  for i, v in ipairs(got) do
    local c = ecount(v)
    if have + c > k then
      local a, b = qb_split(v, k - have)
      redis.call('LPOP', key, i)
      redis.call('LPUSH', key, b)
      out[#out + 1] = a
      return out, k, dx - (k - have)
    end
    out[#out + 1] = v
    have = have + c
    dx = dx - (c - 1)
    if have == k then break end
  end
  if #out > 0 then redis.call('LPOP', key, #out) end
  return out, have, dx
end

-- The batch ids of the 'QS|' references among vals, each once, in order, with their
-- counts. A run of rows of one batch costs a plain find per row, no new string.
local function qs_bids(vals)
  local order, counts, last, lastbid = {}, {}, nil, nil
  for _, v in ipairs(vals) do
    if LIST and is_qb(v) then
      local bid, _, rows = qb_parse(v)
      if bid then
        if not counts[bid] then
          order[#order + 1] = bid
          counts[bid] = 0
        end
        counts[bid] = counts[bid] + rows
      end
    elseif sbyte(v, OFF + 1) == Q and sbyte(v, OFF + 2) == SB then
      if not (last and sfind(v, last, OFF + 1, true) == OFF + 1) then
        lastbid = string.match(string.sub(v, OFF + 1, OFF + 64), '^QS|([^|]+)|')
        last = lastbid and ('QS|' .. lastbid .. '|')
        if lastbid and not counts[lastbid] then
          order[#order + 1] = lastbid
          counts[lastbid] = 0
        end
      end
      if lastbid then counts[lastbid] = counts[lastbid] + 1 end
    end
  end
  return order, counts
end

local function chunk_ttl(vals, ms)
  local batches = false
  for _, v in ipairs(vals) do
    if sbyte(v, OFF + 1) == Q then
      local tag = sbyte(v, OFF + 2)
      if tag == R then
        local bid, n = string.match(string.sub(v, OFF + 1, OFF + 64), '^QR|([^|]+)|(%d+)|')
        if bid and tonumber(n) <= MAX_CHUNKS then  -- more: a corrupt reference
          for k = 0, tonumber(n) - 1 do
            local key = P .. 'b:' .. bid .. ':' .. k
            if ms then redis.call('PEXPIRE', key, ms) else redis.call('PERSIST', key) end
          end
        end
      elseif tag == SB or tag == BB then
        batches = true
      end
    end
  end
  if batches and not ms then
    for _, bid in ipairs((qs_bids(vals))) do
      redis.call('PERSIST', P .. 'b:' .. bid)
      redis.call('PERSIST', P .. 'b:' .. bid .. ':u')
    end
  end
end

-- Release batch rows that will never be stored or delivered.
local function qs_drop(vals)
  local order, counts = qs_bids(vals)
  for _, bid in ipairs(order) do
    local bk = P .. 'b:' .. bid
    -- a count that is no integer (corrupt) is left as it is, and the buffer with it:
    -- failing here would fail the ack of rows already delivered
    local left = redis.pcall('DECRBY', bk .. ':u', counts[bid])
    if type(left) == 'number' and left <= 0 then
      redis.call('DEL', bk, bk .. ':u')
    end
  end
end

-- A delivery (not acknowledged) of exactly one batch entry holding the last unread rows
-- of its buffer takes the buffer: it is renamed b:<id> (and its count b:<id>:u), id the
-- dequeue's, so that the caller reads it in the same round trip as the reply (it
-- pipelines GET b:<id> after the script). It then expires with the delivery record
-- (RECORD_MS), unless the caller's next dequeue drops it first (fast_drop_record) or the
-- delivery is undone: putting the entry back persists the buffer under its new name.
-- Returns vals, or the entry renamed.
local function hand_over(id, vals)
  if not LIST or #vals ~= 1 or not is_qb(vals[1]) then return vals end
  local bid, first, rows, size = qb_parse(vals[1])
  if not bid then return vals end
  local given = fast_hand_over(P, bid, id, first, rows, size)  -- fast_common.lua
  return given and {given} or vals
end

local function size()
  if SHUFFLE then return S.n end
  if PRIO then return redis.call('ZCARD', ITEMS) end
  return redis.call('LLEN', ITEMS) + S.x
end

-- How many elements a dequeue may remove now: a shuffle queue keeps min_after_dequeue
-- elements back until it is closed.
local function takeable()
  local n = size()
  if SHUFFLE and not CLOSED then
    return math.max(0, n - MINAFTER)
  end
  return n
end

-- kept: the values' out-of-line bytes are already persistent (they come from a pending
-- enqueue's a:<id>:p, which persisted them on entry), so the scan is skipped.
local function push_back(vals, kept)
  if #vals == 0 then return end
  if not kept then chunk_ttl(vals, nil) end
  if SHUFFLE then
    for i = 1, #vals do
      redis.call('HSET', ITEMS, S.n, vals[i])
      S.n = S.n + 1
    end
  elseif PRIO then
    for _, v in ipairs(vals) do
      if string.sub(v, 9, 24) == PLACEHOLDER then
        S.seq = S.seq + 1
        v = string.sub(v, 1, 8) .. string.format('%016d', S.seq) .. string.sub(v, 25)
      end
      redis.call('ZADD', ITEMS, 0, v)
    end
  else
    rpush_all(ITEMS, vals)
    S.x = S.x + nelems(vals) - #vals
  end
end

-- Put vals back at the front, vals[1] first (a shuffle queue has no front; a priority
-- queue's elements go back to the place their key gives them).
local function push_front(vals)
  if #vals == 0 then return end
  if not LIST then return push_back(vals) end
  chunk_ttl(vals, nil)
  local rev = {}
  for i = #vals, 1, -1 do rev[#rev + 1] = vals[i] end
  for i = 1, #rev, BATCH do
    redis.call('LPUSH', ITEMS, unpack(rev, i, math.min(i + BATCH - 1, #rev)))
  end
  S.x = S.x + nelems(vals) - #vals
end

-- Remove k elements (k <= size()): the entries at the head of the list standing for k
-- elements, the k lowest members of a priority queue's sorted set, or k uniform picks
-- from the shuffle hash
-- (each pick moves the last slot into the gap: O(1) per element). The generator is
-- Park-Miller (multiplier 48271, modulus 2^31-1): exact in Lua's doubles, seeded per queue.
local function take(k)
  if k <= 0 then return {} end
  if LIST then
    if S.x == 0 then return redis.call('LPOP', ITEMS, k) end
    local out, _, dx = pop_elems(ITEMS, k)
    S.x = S.x + dx
    return out
  end
  if PRIO then
    local got = redis.call('ZPOPMIN', ITEMS, k)
    local out = {}
    for i = 1, #got, 2 do out[#out + 1] = got[i] end
    return out
  end
  local n, s = S.n, S.rng
  local out = {}
  for i = 1, k do
    s = (s * 48271) % 2147483647
    local r = s % n
    local last = n - 1
    out[i] = redis.call('HGET', ITEMS, r)
    if r ~= last then
      redis.call('HSET', ITEMS, r, redis.call('HGET', ITEMS, last))
    end
    redis.call('HDEL', ITEMS, last)
    n = n - 1
  end
  S.n, S.rng = n, s
  return out
end

local function parse(e)
  local t = string.sub(e, 1, 1)
  if t == 'd' then
    local n, mode, id = string.match(e, '^d|(%d+)|(%a+)|(.+)$')
    if string.sub(mode, -1) == 'A' then mode = string.sub(mode, 1, -2) end
    return t, id, tonumber(n), mode
  end
  return t, string.sub(e, 3)
end

-- Whether attempt entry e is an acknowledged dequeue.
local function acked_entry(e)
  return string.sub(e, 1, 2) == 'd|' and string.match(e, '^d|%d+|%a+A|') ~= nil
end

-- Whether other consumers than the client of attempt id hold delivered elements ('r|<id>'
-- leases, ids '<client>.<n>'): acknowledged deliveries not yet acked, or deliveries not
-- yet collected. On a closed queue such elements may still come back (a nack, a lease
-- that runs out), so an acknowledged dequeue waits for them instead of reporting the end
-- of the queue. Its own client's deliveries do not count: it would wait for itself (a
-- consumer that holds a delivery until more come, as a synchronous PS shard does).
local function holds(id)
  if S.w == 0 then return false end
  local mine = (string.match(id, '^(.*)%.%d+$') or id) .. '.'
  for _, e in ipairs(redis.call('ZRANGE', LEASE, 0, -1)) do
    if string.sub(e, 1, 2) == 'r|' and string.sub(e, 3, 2 + #mine) ~= mine then return true end
  end
  return false
end

local function signal(id, status)
  redis.call('SET', akey(id, 's'), status, 'PX', RECORD_MS)
  redis.call('RPUSH', akey(id, 'w'), 1)
  redis.call('PEXPIRE', akey(id, 'w'), RECORD_MS)
end

-- Drop what a pending enqueue had not inserted; its out-of-line chunks expire.
local function drop_pending(id)
  local pk = akey(id, 'p')
  local vals = redis.call('LRANGE', pk, 0, -1)
  chunk_ttl(vals, 1000)
  qs_drop(vals)
  redis.call('DEL', pk)
end

local function finish_enq(e, id, status)
  lease_del(e)
  signal(id, status)
end

local function finish_deq(e, id, status, count)
  lease_del(e)
  if status == 'ok' then
    lease_add('r|' .. id)
    S.deq = S.deq + count
  end
  signal(id, status)
end

-- Fail every pending enqueue (their inserted prefixes stay); a pending close completes.
local function cancel_enqueues(status)
  local all = redis.call('LRANGE', EW, 0, -1)
  for _, e in ipairs(all) do
    local t, id = parse(e)
    lease_del(e)
    if t == 'e' then
      drop_pending(id)
      signal(id, status)
    else
      signal(id, 'already')  -- a later close of a queue that is closed now
    end
  end
  redis.call('DEL', EW)
end

-- The elements a dequeue attempt holds so far.
local function held_count(hk)
  if redis.call('LLEN', hk) == 0 then return 0 end
  return nelems(redis.call('LRANGE', hk, 0, -1))
end

-- Serve pending attempts in arrival order until nothing moves: enqueues at the head of
-- ew insert what fits, a close at the head closes the queue, the dequeue at the head of
-- dw takes what it may (head-of-line blocking, as in TensorFlow's attempt lists).
local function flush()
  if S.w == 0 then return end
  local progress = true
  while progress do
    progress = false
    while true do
      local e = redis.call('LINDEX', EW, 0)
      if not e then break end
      local t, id = parse(e)
      if t == 'c' then
        redis.call('LPOP', EW)
        set_closed()
        finish_enq(e, id, 'ok')
        cancel_enqueues('closed')
        progress = true
        break
      end
      local pk = akey(id, 'p')
      local space = BATCH
      if CAP >= 0 then space = math.min(BATCH, CAP - size()) end
      if space <= 0 then break end
      local vals, have = pop_elems(pk, space)
      if have > 0 then
        push_back(vals, true)
        S.enq = S.enq + have
        progress = true
      end
      if redis.call('LLEN', pk) > 0 then break end
      redis.call('LPOP', EW)
      finish_enq(e, id, 'ok')
      progress = true
    end
    while true do
      local e = redis.call('LINDEX', DW, 0)
      if not e then break end
      local _, id, n, mode = parse(e)
      local hk = akey(id, 'h')
      local held = held_count(hk)
      local k = math.min(n - held, takeable())
      if k > 0 then
        rpush_all(hk, take(k))
        held = held + k
        progress = true
      end
      if held >= n then
        redis.call('LPOP', DW)
        if LIST and not acked_entry(e) and redis.call('LLEN', hk) == 1 then
          local vals = redis.call('LRANGE', hk, 0, -1)
          local given = hand_over(id, vals)
          if given[1] ~= vals[1] then redis.call('LSET', hk, 0, given[1]) end
        end
        finish_deq(e, id, 'ok', held)
        progress = true
      elseif CLOSED and not (held == 0 and acked_entry(e) and holds(id)) then
        redis.call('LPOP', DW)
        progress = true
        if mode == 'upto' and held > 0 then
          finish_deq(e, id, 'ok', held)
        else
          push_front(redis.call('LRANGE', hk, 0, -1))
          redis.call('DEL', hk)
          finish_deq(e, id, 'oor:' .. size(), 0)
        end
      else
        break
      end
    end
  end
end

-- Undo a dequeue: whatever it holds (partial, finished or just delivered) goes back to
-- the front in order, and the delivered count is corrected.
local function undo_dequeue(e, id)
  local hk = akey(id, 'h')
  local vals = redis.call('LRANGE', hk, 0, -1)  -- first: a corrupt record fails before a write
  local pending = (redis.call('LREM', DW, 1, e) > 0)
  lease_del(e, 'r|' .. id)
  redis.call('DEL', hk)
  push_front(vals)
  if not pending and #vals > 0 then
    S.deq = S.deq - nelems(vals)
  end
end

local function undo_enqueue(e, id)
  redis.call('LREM', EW, 1, e)
  lease_del(e)
  drop_pending(id)
end

local function undo(e)
  local t, id = parse(e)
  if t == 'd' or t == 'r' then
    undo_dequeue(e, id)
  else
    undo_enqueue(e, id)
  end
  return id
end

-- Attempts whose caller stopped renewing its lease (a dead process) are undone.
local function reap()
  if S.w == 0 then return false end
  local dead = redis.call('ZRANGEBYSCORE', LEASE, '-inf', now(), 'LIMIT', 0, 32)
  for _, e in ipairs(dead) do
    local id = undo(e)
    redis.call('SET', akey(id, 's'), 'expired', 'PX', RECORD_MS)
  end
  return #dead > 0
end

-- The reply for a finished attempt; a dequeue's elements stay in a:<id>:h for a while as
-- a delivery record, so that a caller cancelled before reading the reply can put them back.
-- An acknowledged dequeue (keep) keeps its record and its 'r|<id>' lease until ack, nack
-- or the lease runs out (then reap() puts the elements back).
local function finalize(id, st, keep)
  redis.call('DEL', akey(id, 's'), akey(id, 'w'))
  if st == 'ok' and keep then
    local hk = akey(id, 'h')
    if redis.call('ZSCORE', LEASE, 'r|' .. id) then
      return {'ok', redis.call('LRANGE', hk, 0, -1)}
    end
    return {'expired'}
  end
  if st == 'ok' then
    local hk = akey(id, 'h')
    if lease_del('r|' .. id) > 0 or redis.call('EXISTS', hk) == 1 then
      local vals = redis.call('LRANGE', hk, 0, -1)
      redis.call('PEXPIRE', hk, RECORD_MS)
      chunk_ttl(vals, CHUNK_TTL_MS)
      return {'ok', vals}
    end
  end
  return {st}
end

local function argv_from(i)
  local out = {}
  for j = i, #ARGV do out[#out + 1] = ARGV[j] end
  return out
end
