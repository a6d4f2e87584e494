-- quarantine: A 2.. ids of batch buffers whose rows could not be read (missing or
-- short); ARGV[2..] dead-letter records (element bytes plus reason) for the dlq list.
-- A buffer that is gone takes its count b:<bid>:u with it, and the entries of it at
-- the head of a list queue whose rows it does not hold (the rest of a batch entry that
-- a dequeue split) go to the dlq too: a missing or short buffer of many rows is set
-- aside at once, not a row per dequeue.
if not KIND then return {'gone'} end
local dlq = P .. 'dlq'
local records = argv_from(2)
-- a dead-letter record as qps.queues.decode writes it (msgpack {reason, data})
local function mp_len(t8, t16, t32, n)
  if n < 256 then return string.char(t8, n) end
  if n < 65536 then return string.char(t16, math.floor(n / 256), n % 256) end
  return string.char(t32, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256)
end
local function record(v, why)
  return '\130\166reason' .. mp_len(217, 218, 219, #why) .. why .. '\164data'
    .. mp_len(196, 197, 198, #v) .. v
end
for i = 2, #A do
  local bk = P .. 'b:' .. A[i]
  local have = redis.pcall('STRLEN', bk)  -- a value of the wrong type counts as none
  if type(have) ~= 'number' or redis.call('EXISTS', bk) == 0 then
    have = -1
    redis.call('DEL', bk .. ':u')
  end
  local head = 'QB|' .. A[i] .. '|'
  while LIST do  -- entries of the buffer at the head whose rows lie beyond its bytes
    local v = redis.call('LINDEX', ITEMS, 0)
    if not v or string.sub(v, 1, #head) ~= head then break end
    local _, first, rows, size = qb_parse(v)
    if first and (first + rows) * tonumber(size) <= have then break end
    redis.call('LPOP', ITEMS)
    S.x = math.max(0, S.x - (ecount(v) - 1))
    records[#records + 1] = record(v, 'the buffer of a batch row is missing or too short')
  end
end
if #records > 0 then
  rpush_all(dlq, records)
  redis.call('HINCRBY', META, 'bad', #records)
end
return {'ok'}
