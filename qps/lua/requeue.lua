-- requeue: ARGV[2..] elements a caller took but gives back (in order, to the front).
if not KIND then return {'gone'} end
local vals = argv_from(2)
push_front(vals)
S.deq = S.deq - nelems(vals)
flush()
return {'ok'}
