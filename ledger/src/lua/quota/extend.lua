-- Add to what a held lease costs (a snapshot's disk, known once it is taken), checked against
-- every level of the lease's path like an admission.
-- ARGV: lease id, extra cost (JSON: stored dimension -> amount), defaults (JSON limits)
-- Reply (`Admission`): admitted | denied {...} | missing (no such lease)
local id, extra, defaults = ARGV[1], cjson.decode(ARGV[2]), cjson.decode(ARGV[3])
local raw = redis.call('HGET', LEASE, id)
if not raw then return cjson.encode({ outcome = 'missing' }) end
local l = cjson.decode(raw)
local levels = chain(l.path)
local top = levels[#levels]
for _, p in ipairs(levels) do
  local refusal = over_limit(p, limits(p, top, defaults), extra)
  if refusal then return cjson.encode(refusal) end
end
for _, p in ipairs(levels) do
  for dim, n in pairs(extra) do add(p, dim, n) end
end
for dim, n in pairs(extra) do l.cost[dim] = (l.cost[dim] or 0) + n end
redis.call('HSET', LEASE, id, cjson.encode(l))
return cjson.encode({ outcome = 'admitted' })
