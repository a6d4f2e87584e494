-- Synchronous training: the workers' tokens for update ARGV[1], given by the last of
-- the shards holding variables to commit it; optionally only if this shard's commit of
-- it took, and with its messages of the gradient list acknowledged (one round trip with
-- the commit's scripts, on a single server).
-- KEYS[1]: the update's done counter (the shards that committed it); KEYS[2..1+W]: the
-- workers' token lists; then N variable metas to check; then, if ARGV[7] == '1', the
-- global step's applied ids (the update's id 'sync.<step>' must be among them); then,
-- if ARGV[8] ~= '', the processing list and the shard's lease.
-- ARGV[1]: the update's step, ARGV[2]: the shards that hold variables, ARGV[3]: the
-- done counter's time to live (ms), ARGV[4]: W, ARGV[5]: N, ARGV[6]: the shard's
-- fencing token, ARGV[7]: '1' to check the global step, ARGV[8]: the lease's token to
-- acknowledge with ('' not asked), ARGV[9]: how many messages to trim from the front of
-- the processing list, ARGV[10..9+N]: each variable's version once committed.
-- Reply: {code, acked}: code 1 tokens given; 2 counted, another shard gives them; 0
-- the update is not (all) committed: nothing done. acked: 1 trimmed, 0 the lease is
-- another's (nothing trimmed), -1 not asked (or code 0).
local step, needed = ARGV[1], tonumber(ARGV[2])
local w, n = tonumber(ARGV[4]), tonumber(ARGV[5])
local at = 2 + w
for i = 1, n do
  local m = redis.call('HMGET', KEYS[at + i - 1], 'token', 'ver')
  if tonumber(m[1]) ~= tonumber(ARGV[6]) or tonumber(m[2]) ~= tonumber(ARGV[9 + i]) then
    return {0, -1}
  end
end
at = at + n
if ARGV[7] == '1' then
  if not redis.call('ZSCORE', KEYS[at], 'sync.' .. step) then return {0, -1} end
  at = at + 1
end
local acked = -1
if ARGV[8] ~= '' then
  acked = 0
  local v = redis.call('GET', KEYS[at + 1])
  if v and string.match(v, '^(%d+) ') == ARGV[8] then
    -- LTRIM, not LPOP: popped messages would be copied into Lua strings
    if tonumber(ARGV[9]) > 0 then redis.call('LTRIM', KEYS[at], ARGV[9], -1) end
    acked = 1
  end
end
if needed > 1 then
  local count = redis.call('INCR', KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  if count ~= needed then return {2, acked} end
end
for i = 2, 1 + w do redis.call('RPUSH', KEYS[i], step) end
return {1, acked}
