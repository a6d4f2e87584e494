-- A variable's writes (qps.variables): ARGV[1] names the write, ARGV[2..] are its own
-- arguments (ARGV below, from here on, is that rest). KEYS[1] is the meta hash P meta;
-- the data keys are derived from its prefix P and share its hash tag, hence its slot.
--
--   create      ARGV: spec, gen, nbytes, nseg, segb. Commits generation gen (written
--               beforehand with a TTL) as version 0. {'ok'}, {'exists', spec},
--               {'missing'}.
--   publish     ARGV: token, version, gen, nseg, prev TTL (ms), nbytes[, slots, id, t,
--               keep, id...]. Flips the value to generation gen; with the optional ones
--               (a PS shard's commit) the slots "name,..." written under gen become
--               current too, t is stored and the message ids (id and any after keep)
--               are recorded as applied (ids older than keep ms are forgotten).
--   publish_rows KEYS[2]: the staged rows. ARGV: token, version, staged bytes, variable
--               bytes, runs "segment offset length,..."[, slots, id, t, keep, id...].
--               Copies the staged runs (the value's, then each slot's in the order of
--               "slots") into the current generations in place.
--   init_slots  ARGV: token, slot gen, slots "name,...", nbytes, nseg. Makes the slots
--               written under slot gen current; keeps t (0 if none).
--   fence       ARGV: token. Raises the stored token. {'ok', version}.
--
-- Every write replies {'ok'...} or a refusal: {'gone'}, {'stale', token}, {'version',
-- ver}, {'held', ms left}, {'dup', id}, {'slots', stored slots}, {'changed', nbytes},
-- {'missing'[, nbytes]} or {'corrupt', what}; a refused write deletes what it would
-- have committed.
local op, rest = ARGV[1], {}
for i = 2, #ARGV do rest[i - 1] = ARGV[i] end
local ARGV = rest
local P = string.sub(KEYS[1], 1, -5)
local function now_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
local function seg_key(gen, i) return P .. 'd:' .. gen .. ':' .. i end
local function each_seg(gen, nseg, cmd, arg)
  for i = 0, nseg - 1 do
    if arg then redis.call(cmd, seg_key(gen, i), arg) else redis.call(cmd, seg_key(gen, i)) end
  end
end
-- whether key k is there with length n (STRLEN is 0 for a missing key)
local function has_length(k, n)
  if n > 0 then return redis.call('STRLEN', k) == n end
  return redis.call('EXISTS', k) == 1
end
-- the first segment of generation gen that is not there with its full length, or nil
local function incomplete(gen, nseg, segb, nbytes)
  for i = 0, nseg - 1 do
    local k = seg_key(gen, i)
    if not has_length(k, math.min(segb, nbytes - i * segb)) then return k end
  end
  return nil
end
local function split(csv)
  local out = {}
  if csv then for x in string.gmatch(csv, '[^,]+') do out[#out + 1] = x end end
  return out
end
local function slot_key(gen, slot, i) return P .. 'o:' .. gen .. ':' .. slot .. ':' .. i end
local function each_slot_seg(gen, names, nseg, cmd, arg)
  for _, s in ipairs(names) do
    for i = 0, nseg - 1 do
      local k = slot_key(gen, s, i)
      if arg then redis.call(cmd, k, arg) else redis.call(cmd, k) end
    end
  end
end
local function slots_incomplete(gen, names, nseg, segb, nbytes)
  for _, s in ipairs(names) do
    for i = 0, nseg - 1 do
      local k = slot_key(gen, s, i)
      if not has_length(k, math.min(segb, nbytes - i * segb)) then return k end
    end
  end
  return nil
end
-- the refusal of a write whose meta field f holds v (false: missing) instead of what
-- ``want`` says (qps.varcheck checks the same where Python reads the meta)
local function corrupt(f, v, want)
  local held = v and ('holds ' .. string.format('%q', v)) or 'is missing'
  return {'corrupt', KEYS[1] .. " field '" .. f .. "' " .. held .. ', not ' .. want}
end
local function is_count(v)
  return v and #v <= 16 and string.match(v, '^%d+$') ~= nil and tonumber(v) < 9007199254740992
end
-- nil, or the refusal naming the first field {index in m, name} that is not an integer
-- in [0, 2**53) (a missing one passes when ``optional``)
local function bad_count(m, fields, optional)
  for _, f in ipairs(fields) do
    local v = m[f[1]]
    if not (is_count(v) or (optional and not v)) then
      return corrupt(f[2], v, 'an integer in [0, 2**53)')
    end
  end
  return nil
end
-- the message ids of a commit: ARGV[first] and ARGV[more..] (a group commit names
-- several); '' names none
local function commit_ids(first, more)
  local ids = {}
  if ARGV[first] and ARGV[first] ~= '' then ids[1] = ARGV[first] end
  for i = more, #ARGV do ids[#ids + 1] = ARGV[i] end
  return ids
end
-- ids per command of a script (unpack puts each argument on Lua's C stack)
local IDS_PER_CALL = 500
-- an error if a message id was applied already or the slots differ from the stored ones
-- (``have``: the meta's 'slots')
local function check_commit(names_csv, ids, have)
  for at = 1, #ids, IDS_PER_CALL do
    local part = {unpack(ids, at, math.min(#ids, at + IDS_PER_CALL - 1))}
    local seen = redis.call('ZMSCORE', P .. 'applied', unpack(part))
    for i = 1, #part do
      if seen[i] then return {'dup', part[i]} end
    end
  end
  if names_csv and names_csv ~= have then return {'slots', have} end
  return nil
end
-- remember that the message ids were applied (at ``now``, read here if not given);
-- forget ids older than keep ms
local function record_applied(ids, keep, now)
  if #ids == 0 then return end
  now = tonumber(now or now_ms())
  for at = 1, #ids, IDS_PER_CALL do
    local args = {}
    for i = at, math.min(#ids, at + IDS_PER_CALL - 1) do
      args[#args + 1] = now
      args[#args + 1] = ids[i]
    end
    redis.call('ZADD', P .. 'applied', unpack(args))
  end
  redis.call('ZREMRANGEBYSCORE', P .. 'applied', '-inf',
    '(' .. string.format('%.0f', now - tonumber(keep)))
end
-- a small variable (one segment of at most CUR_MAX bytes) keeps a copy of its value at
-- version ver in P cur (and ver in the meta's 'curver', or in ``fields``, the caller's
-- own write of the meta), which readers get with a plain GET inside MULTI: no bytes
-- through Lua. The copy ends with ver as 16 hex digits: a reader takes it only with
-- that suffix at its layout's length plus 16, so a copy overwritten by anything else
-- sends the reader to the segment itself
local CUR_MAX = 1048576  -- qps.varspec.CHUNK_BYTES (a test checks they agree)
local function keep_current(gen, nseg, nbytes, ver, fields)
  if tonumber(nseg) == 1 and tonumber(nbytes) <= CUR_MAX then
    redis.call('COPY', seg_key(gen, 0), P .. 'cur', 'REPLACE')
    redis.call('APPEND', P .. 'cur', string.format('%016x', tonumber(ver)))
    if fields then  -- the caller's meta write takes 'curver'
      fields[#fields + 1] = 'curver'
      fields[#fields + 1] = ver
    else
      redis.call('HSET', KEYS[1], 'curver', ver)
    end
  end
end
-- nil if no checkpoint holds the variable, else the refusal 'held' with the ms the
-- hold has left (a snapshot on Redis Cluster holds every variable while it pins them
-- all: qps.checkpoint); a hold past its time is no hold. ``h``: the meta's 'hold' if
-- the caller read it (false: none), else it is read here
local function held(h)
  if h == nil then h = redis.call('HGET', KEYS[1], 'hold') end
  if not h then return nil end
  if not is_count(h) then return corrupt('hold', h, 'a time in ms') end
  local left = tonumber(h) - tonumber(now_ms())
  if left <= 0 then return nil end
  return {'held', string.format('%.0f', left)}
end
-- nil (and the meta fields) if a write with this token and version may proceed; the
-- fields named after ``version`` are read too (m[8] on). A meta without a field it
-- needs, or with one that is not a count, is refused as corrupt
local function check(token, version, ...)
  local m = redis.call('HMGET', KEYS[1], 'token', 'ver', 'gen', 'prev', 'nbytes', 'nseg',
    'segb', ...)
  if not m[1] and redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'}, m end
  local bad = bad_count(m, {{1, 'token'}, {2, 'ver'}, {5, 'nbytes'}, {6, 'nseg'}, {7, 'segb'}})
  if not bad and not (m[3] and m[3] ~= '') then bad = corrupt('gen', m[3], 'a generation id') end
  if bad then return bad, m end
  if tonumber(token) < tonumber(m[1]) then return {'stale', m[1]}, m end
  if version and tonumber(version) <= tonumber(m[2]) then return {'version', m[2]}, m end
  return nil, m
end

local function create()
  local gen, nseg = ARGV[2], tonumber(ARGV[4])
  if redis.call('EXISTS', KEYS[1]) == 1 then
    each_seg(gen, nseg, 'DEL')
    return {'exists', redis.call('HGET', KEYS[1], 'spec')}
  end
  if incomplete(gen, nseg, tonumber(ARGV[5]), tonumber(ARGV[3])) then
    each_seg(gen, nseg, 'DEL')
    return {'missing'}
  end
  each_seg(gen, nseg, 'PERSIST')
  local now = now_ms()
  redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'gen', gen, 'ver', '0', 'token', '0',
    'prev', '', 'pver', '', 'nbytes', ARGV[3], 'nseg', ARGV[4], 'segb', ARGV[5],
    'ctime', now, 'mtime', now, 'publishes', '0', 'row_publishes', '0')
  keep_current(gen, nseg, ARGV[3], '0')
  return {'ok'}
end

local function publish()
  local gen, nseg = ARGV[3], tonumber(ARGV[4])
  local names = split(ARGV[7])
  local ids = commit_ids(8, 11)
  -- the commit's other fields read with the check: m[8] hold, m[9] slots, m[10] sgen,
  -- m[11] publishes
  local err, m = check(ARGV[1], nil, 'hold', 'slots', 'sgen', 'publishes')
  if not err then err = held(m[8]) or bad_count(m, {{11, 'publishes'}}, true) end
  if not err then err = check_commit(ARGV[7], ids, m[9] or '') end
  if not err and tonumber(ARGV[2]) <= tonumber(m[2]) then err = {'version', m[2]} end
  if not err and (m[5] ~= ARGV[6] or m[6] ~= ARGV[4]) then err = {'changed', m[5]} end
  if not err and (incomplete(gen, nseg, tonumber(m[7]), tonumber(m[5])) or
      slots_incomplete(gen, names, nseg, tonumber(m[7]), tonumber(m[5]))) then
    err = {'missing', m[5]}
  end
  if err then
    each_seg(gen, nseg, 'DEL')
    each_slot_seg(gen, names, nseg, 'DEL')
    return err
  end
  each_seg(gen, nseg, 'PERSIST')
  if m[4] and m[4] ~= '' then each_seg(m[4], nseg, 'DEL') end
  each_seg(m[3], nseg, 'PEXPIRE', ARGV[5])
  local now = now_ms()
  -- one write of the meta: the new generation, the count, keep_current()'s version and
  -- the commit's slot generation and t
  local fields = {'gen', gen, 'ver', ARGV[2], 'prev', m[3], 'pver', m[2], 'token', ARGV[1],
    'mtime', now, 'publishes', string.format('%.0f', (tonumber(m[11]) or 0) + 1)}
  keep_current(gen, nseg, m[5], ARGV[2], fields)
  if ARGV[7] then
    each_slot_seg(gen, names, nseg, 'PERSIST')
    local sg = m[10]
    if sg and sg ~= '' and sg ~= gen then each_slot_seg(sg, names, nseg, 'DEL') end
    for _, f in ipairs({'sgen', gen, 't', ARGV[9]}) do fields[#fields + 1] = f end
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  if ARGV[7] then record_applied(ids, ARGV[10], now) end
  return {'ok'}
end

local function publish_rows()
  local names = split(ARGV[6])
  local ids = commit_ids(7, 10)
  -- m[8] hold, m[9] slots, m[10] sgen, m[11] row_publishes
  local err, m = check(ARGV[1], nil, 'hold', 'slots', 'sgen', 'row_publishes')
  if not err then err = held(m[8]) or bad_count(m, {{11, 'row_publishes'}}, true) end
  if not err then err = check_commit(ARGV[6], ids, m[9] or '') end
  if not err and tonumber(ARGV[2]) <= tonumber(m[2]) then err = {'version', m[2]} end
  if not err and m[5] ~= ARGV[4] then err = {'changed', m[5]} end
  if err then
    redis.call('DEL', KEYS[2])
    return err
  end
  local buf = redis.call('GET', KEYS[2])
  redis.call('DEL', KEYS[2])
  if not buf or #buf ~= tonumber(ARGV[3]) then return {'missing', ARGV[3]} end
  local nseg, segb, nbytes = tonumber(m[6]), tonumber(m[7]), tonumber(m[5])
  local sgen = m[10] or ''
  if #names > 0 and sgen == '' then return corrupt('sgen', m[10], 'a generation id') end
  local bad = incomplete(m[3], nseg, segb, nbytes) or
    (#names > 0 and slots_incomplete(sgen, names, nseg, segb, nbytes))
  if bad then return {'corrupt', bad .. ' is missing or not of the length its layout says'} end
  local block = #buf / (#names + 1)
  -- the runs, parsed once for the value and every slot
  local segs, los, lens, nruns = {}, {}, {}, 0
  for seg, lo, n in string.gmatch(ARGV[5], '(%d+) (%d+) (%d+)') do
    nruns = nruns + 1
    segs[nruns], los[nruns], lens[nruns] = seg, lo, tonumber(n)
  end
  local call, sub = redis.call, string.sub
  for b = 0, #names do
    local pos = 1 + b * block
    local names_of = {}
    for j = 1, nruns do
      local seg, n = segs[j], lens[j]
      local k = names_of[seg]
      if not k then
        k = b == 0 and seg_key(m[3], seg) or slot_key(sgen, names[b], seg)
        names_of[seg] = k
      end
      call('SETRANGE', k, los[j], sub(buf, pos, pos + n - 1))
      pos = pos + n
    end
  end
  redis.call('HSET', KEYS[1], 'ver', ARGV[2], 'token', ARGV[1], 'mtime', now_ms())
  redis.call('HINCRBY', KEYS[1], 'row_publishes', 1)
  keep_current(m[3], nseg, nbytes, ARGV[2])
  if ARGV[6] then
    redis.call('HSET', KEYS[1], 't', ARGV[8])
    record_applied(ids, ARGV[9])
  end
  return {'ok'}
end

local function init_slots()
  local gen, nseg = ARGV[2], tonumber(ARGV[5])
  local names = split(ARGV[3])
  local err, m = check(ARGV[1], nil)
  if not err then err = held() end
  if not err and (m[5] ~= ARGV[4] or m[6] ~= ARGV[5]) then err = {'changed', m[5]} end
  if not err and slots_incomplete(gen, names, nseg, tonumber(m[7]), tonumber(m[5])) then
    err = {'missing', m[5]}
  end
  if err then
    each_slot_seg(gen, names, nseg, 'DEL')
    return err
  end
  each_slot_seg(gen, names, nseg, 'PERSIST')
  local old = redis.call('HMGET', KEYS[1], 'sgen', 'slots')
  if old[1] and old[1] ~= '' and old[1] ~= gen then
    each_slot_seg(old[1], split(old[2]), nseg, 'DEL')
  end
  redis.call('HSET', KEYS[1], 'sgen', gen, 'slots', ARGV[3], 'token', ARGV[1])
  redis.call('HSETNX', KEYS[1], 't', '0')
  return {'ok'}
end

local function fence()
  local err, m = check(ARGV[1], nil)
  if err then return err end
  redis.call('HSET', KEYS[1], 'token', ARGV[1])
  return {'ok', m[2]}
end

local writes = {
  create = create, publish = publish, publish_rows = publish_rows,
  init_slots = init_slots, fence = fence,
}
return writes[op]()
