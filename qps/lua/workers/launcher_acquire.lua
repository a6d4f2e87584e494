-- Take the launcher's lease on a container (workers/lifecycle.py).
-- KEYS[1]: the lease (its holder's JSON record).
-- ARGV[1]: our record; ARGV[2]: the lease's time to live in ms; ARGV[3]: a holder we
-- may replace (one found gone, or ours), or ''.
-- Sets the lease if it is free or holds ARGV[3]: replies {1, ARGV[1]}; else {0, the
-- holder}.
local cur = redis.call('GET', KEYS[1])
if (not cur) or (ARGV[3] ~= '' and cur == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1]}
end
return {0, cur}
