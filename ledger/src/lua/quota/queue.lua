-- A held lease enters or leaves a wait queue: entering checks `queued` at every level.
-- ARGV: lease id, 'enter' | 'leave', defaults (JSON limits)
-- Reply (`Admission`): admitted | denied {...} | missing (no such lease)
local id, op, defaults = ARGV[1], ARGV[2], cjson.decode(ARGV[3])
local raw = redis.call('HGET', LEASE, id)
if not raw then return cjson.encode({ outcome = 'missing' }) end
local l = cjson.decode(raw)
local levels = chain(l.path)
local top = levels[#levels]
if op == 'enter' then
  if l.queued == 1 then return cjson.encode({ outcome = 'admitted' }) end
  for _, p in ipairs(levels) do
    local refusal = over_limit(p, limits(p, top, defaults), { queued = 1 })
    if refusal then return cjson.encode(refusal) end
  end
  for _, p in ipairs(levels) do add(p, 'queued', 1) end
  l.queued = 1
elseif l.queued == 1 then
  for _, p in ipairs(levels) do add(p, 'queued', -1) end
  l.queued = 0
end
redis.call('HSET', LEASE, id, cjson.encode(l))
return cjson.encode({ outcome = 'admitted' })
