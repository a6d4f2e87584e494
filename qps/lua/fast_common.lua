-- Helpers of the fast paths (<name>_fast.lua) that the queue library (queue_common.lua)
-- uses too: qps.transport puts this file first in every queue script.

-- Every queue script takes one key, the meta hash of one queue,
-- 'qps:{<container>/q/<name>}:meta', and derives the others from its prefix: anything
-- else is refused before a key is touched (no key outside the queue's own).
if #KEYS ~= 1 or not string.find(KEYS[1], '^qps:{[^{}/]+/q/[^{}]+}:meta$') then
  return redis.error_reply('ERR qps: a queue script takes one key, a queue meta hash ' ..
    "'qps:{<container>/q/<name>}:meta'")
end

-- A count field of the meta hash as the fast paths need it: false (missing) is 0; nil
-- for anything but an integer >= 0 (the fast path then leaves it to the full script,
-- which reports it).
local function fast_count(v)
  if not v then return 0 end
  local n = tonumber(v)
  if not n or n < 0 or n ~= math.floor(n) or n > 9007199254740991 then return nil end
  return n
end

-- hand_over: a delivery of every unread row of buffer b:<bid> (<rows> of them, from
-- row <first>) to attempt <id> takes the buffer along, renamed b:<id> (its consumer
-- reads it in the delivery's round trip; see hand_over in queue_common.lua). Returns
-- the batch entry that stands for the rows then; nil, having changed nothing, when the
-- buffer is not all unread or not there (its rows are then read by reference).
local function fast_hand_over(P, bid, id, first, rows, size)
  local bk = P .. 'b:' .. bid
  if bid == id or tonumber(redis.call('GET', bk .. ':u') or '') ~= rows
      or redis.call('EXISTS', bk) == 0 then
    return nil
  end
  local nk = P .. 'b:' .. id
  redis.call('RENAME', bk, nk)
  redis.call('RENAME', bk .. ':u', nk .. ':u')
  redis.call('PEXPIRE', nk, 60000)  -- RECORD_MS
  redis.call('PEXPIRE', nk .. ':u', 60000)
  return string.format('QB|%s|%s|%d|%s', id, first, rows, size)
end

-- The <bid> of a reference 'QR|<bid>|1|<bytes>' to an element stored out of line in one
-- chunk, b:<bid>:0; nil for any other value.
local function one_chunk_bid(v)
  return string.match(v, '^QR|([^|]+)|1|%d+$')
end

-- Such a reference taken by attempt <id>: the chunk is renamed b:<id>:0, so that the
-- consumer reads it in the take's own round trip (it sends GET b:<id>:0 after the
-- script) and its next dequeue drops it with the delivery record (fast_drop_record).
-- Returns the reference to deliver (renamed, or v itself: not such a reference, or no
-- chunk) and its chunk's key (nil if v is not such a reference).
local function fast_take_chunk(P, v, id)
  local b1, b2, b3 = string.byte(v, 1, 3)
  if not (b1 == 81 and b2 == 82 and b3 == 124) then return v, nil end
  local bid = one_chunk_bid(v)
  if not bid then return v, nil end
  local ck = P .. 'b:' .. bid .. ':0'
  if bid == id or redis.call('EXISTS', ck) == 0 then return v, ck end
  local nk = P .. 'b:' .. id .. ':0'
  redis.call('RENAME', ck, nk)
  return 'QR|' .. id .. string.sub(v, #bid + 4), nk
end

-- The caller of dequeue <id> is done with its delivery: drop the record,
-- and a buffer (fast_hand_over) or a chunk (fast_take_chunk) it took.
local function fast_drop_record(P, id)
  local bk = P .. 'b:' .. id
  redis.call('DEL', P .. 'a:' .. id .. ':h', bk, bk .. ':u', bk .. ':0')
end
