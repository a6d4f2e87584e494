-- The global step advanced by PS shard 0. KEYS[1]: the counter's value, KEYS[2]: its
-- applied ids (id -> server time, ms). ARGV[1]: how long an id stays recorded (ms);
-- ARGV[2..]: message ids. Advances the counter by one per id not recorded yet, records
-- them, and drops ids older than ARGV[1]. Reply: {how many it advanced, the value}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for i = 2, #ARGV do
  if not redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], now, ARGV[i])
    n = n + 1
  end
end
local old = '(' .. string.format('%.0f', now - tonumber(ARGV[1]))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', old)
if n == 0 then return {0, redis.call('GET', KEYS[1]) or '0'} end
return {n, redis.call('INCRBY', KEYS[1], n)}
