-- Recompute usage from the leases held and compare it with the counted usage; with fix = '1',
-- replace the counted usage by the recomputed one.
-- ARGV: fix
-- Reply: {drift = [{path, dimension, counted, recomputed}]}
local now = now_ms()
expire_due(now)
local want = {}
local leases = redis.call('HGETALL', LEASE)
for i = 1, #leases, 2 do
  local l = cjson.decode(leases[i + 1])
  for _, p in ipairs(chain(l.path)) do
    for dim, n in pairs(l.cost) do
      local f = p .. '|' .. dim
      want[f] = (want[f] or 0) + n
    end
    if l.queued == 1 then
      local f = p .. '|queued'
      want[f] = (want[f] or 0) + 1
    end
  end
end
local have = {}
local flat = redis.call('HGETALL', USE)
for i = 1, #flat, 2 do have[flat[i]] = tonumber(flat[i + 1]) end
local drift = {}
local function note(f, counted, recomputed)
  local cut = string.match(f, '^.*()|')
  drift[#drift + 1] = { path = string.sub(f, 1, cut - 1), dimension = string.sub(f, cut + 1), counted = counted, recomputed = recomputed }
end
for f, n in pairs(want) do
  if n ~= 0 and (have[f] or 0) ~= n then note(f, have[f] or 0, n) end
end
for f, n in pairs(have) do
  if want[f] == nil and n ~= 0 then note(f, n, 0) end
end
if ARGV[1] == '1' and #drift > 0 then
  redis.call('DEL', USE)
  for f, n in pairs(want) do
    if n ~= 0 then redis.call('HSET', USE, f, n) end
  end
end
return cjson.encode({ drift = drift })
