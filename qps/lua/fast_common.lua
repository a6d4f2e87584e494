-- Helpers of the fast paths (<name>_fast.lua) that the queue library (queue_common.lua)
-- uses too: qps.transport puts this file first in every queue script.

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
