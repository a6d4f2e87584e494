-- Deletes a checkpoint's pinned copies of one variable (qps.checkpoint). KEYS[1]: the
-- variable's meta. ARGV[1]: the snapshot id. As many segments and slots as it has now;
-- any others expire. Replies 1.
local pin = string.sub(KEYS[1], 1, -5) .. 'ck:' .. ARGV[1] .. ':'
local m = redis.call('HMGET', KEYS[1], 'nseg', 'slots')
local n = tonumber(m[1] or '0')
for i = 0, n - 1 do redis.call('UNLINK', pin .. 'd:' .. i) end
for s in string.gmatch(m[2] or '', '[^,]+') do
  for i = 0, n - 1 do redis.call('UNLINK', pin .. 'o:' .. s .. ':' .. i) end
end
return 1
