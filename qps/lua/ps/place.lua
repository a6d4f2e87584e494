-- Round-robin placement of variables on PS shards. KEYS[1]: the placement hash (name
-- -> shard), KEYS[2]: the job's config hash (its 'rr' field counts every placement
-- ever made). ARGV[1]: the number of shards; ARGV[2..]: variable names. Places each
-- name not placed yet on shard rr % n (TF's creation order). Reply: each name's shard.
local out = {}
for i = 2, #ARGV do
  local s = redis.call('HGET', KEYS[1], ARGV[i])
  if not s then
    local rr = redis.call('HINCRBY', KEYS[2], 'rr', 1) - 1
    s = tostring(rr % tonumber(ARGV[1]))
    redis.call('HSET', KEYS[1], ARGV[i], s)
  end
  out[#out + 1] = s
end
return out
