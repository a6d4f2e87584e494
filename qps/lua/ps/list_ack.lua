-- A shard's acknowledgement of messages of its gradient list. KEYS[1]: its processing
-- list, KEYS[2]: the shard's lease ("<token> <owner>"). ARGV[1]: the lease's fencing
-- token, ARGV[2]: the tombstone, ARGV[3]: how many elements to drop from the front,
-- ARGV[4..]: indices to overwrite with the tombstone first (acknowledged out of order).
-- Reply: 1 done; 0 refused, nothing changed: the lease does not hold the token.
local v = redis.call('GET', KEYS[2])
if not (v and string.match(v, '^(%d+) ') == ARGV[1]) then return 0 end
for i = 4, #ARGV do redis.call('LSET', KEYS[1], ARGV[i], ARGV[2]) end
-- LTRIM, not LPOP: popped messages would be copied into Lua strings (~1 us per KB)
if tonumber(ARGV[3]) > 0 then redis.call('LTRIM', KEYS[1], ARGV[3], -1) end
return 1
