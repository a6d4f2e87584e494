-- The bytes of the messages waiting in a shard's gradient list (status commands: it
-- reads them all). KEYS[1]: the list. No ARGV. Reply: the total length of its elements.
local n = 0
for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do n = n + #v end
return n
