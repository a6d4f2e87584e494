-- A checkpoint's pin of one variable (qps.checkpoint). KEYS[1]: the variable's meta.
-- ARGV: snapshot id, TTL of the pinned copies (ms)[, hold (ms)]. Copies the segments of
-- the current value generation and of the current slot generation to P ck:<id>:d:<i>
-- and P ck:<id>:o:<slot>:<i> (same hash tag: same slot). With a hold (a snapshot on
-- Redis Cluster) the variable's writes are refused ('held', qps/lua/vars/write.lua)
-- until checkpoint/release or for that long. Replies {'ok', the meta hash as a flat
-- list, the applied ids with their scores}, {'gone'} or {'missing', the key's suffix}.
local P = string.sub(KEYS[1], 1, -5)
if ARGV[3] and redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'hold', string.format('%.0f', until_ms), 'hold_by', ARGV[1])
  redis.call('DEL', P .. 'unheld')
end
local m = redis.call('HGETALL', KEYS[1])
if #m == 0 then return {'gone'} end
local f = {}
for i = 1, #m, 2 do f[m[i]] = m[i + 1] end
local nseg = tonumber(f['nseg'])
local pin = P .. 'ck:' .. ARGV[1] .. ':'
local function copy(src, dst)
  if redis.call('COPY', src, dst, 'REPLACE') == 0 then return false end
  redis.call('PEXPIRE', dst, ARGV[2])
  return true
end
for i = 0, nseg - 1 do
  if not copy(P .. 'd:' .. f['gen'] .. ':' .. i, pin .. 'd:' .. i) then
    return {'missing', 'd:' .. f['gen'] .. ':' .. i}
  end
end
if f['slots'] and f['slots'] ~= '' then
  for s in string.gmatch(f['slots'], '[^,]+') do
    for i = 0, nseg - 1 do
      if not copy(P .. 'o:' .. f['sgen'] .. ':' .. s .. ':' .. i, pin .. 'o:' .. s .. ':' .. i) then
        return {'missing', 'o:' .. f['sgen'] .. ':' .. s .. ':' .. i}
      end
    end
  end
end
return {'ok', m, redis.call('ZRANGE', P .. 'applied', 0, -1, 'WITHSCORES')}
