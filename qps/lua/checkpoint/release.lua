-- Ends a checkpoint's hold of one variable (qps.checkpoint). KEYS[1]: the variable's
-- meta. ARGV[1]: the snapshot id. Ends that snapshot's hold (not another's) and wakes
-- the writers waiting for it (BLPOP on P unheld). Replies 1, or 0 if the snapshot held
-- nothing.
local P = string.sub(KEYS[1], 1, -5)
if redis.call('HGET', KEYS[1], 'hold_by') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'hold', 'hold_by')
redis.call('RPUSH', P .. 'unheld', '1')
redis.call('PEXPIRE', P .. 'unheld', 60000)
return 1
