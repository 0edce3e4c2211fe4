-- The index of top-level tenants whose leases the quota sweep reads (`qtops`, the registry's
-- slot: a tenant's scope is another, so noting a tenant is a step of its own before its
-- admission, and forgetting one must not race it).
-- KEYS: qtops
-- ARGV: 'note', top | 'forget', top, idle_ms
--   note: scores `top` with Redis's time (never lowers it).
--   forget: removes `top` only if nobody noted it for idle_ms. The caller saw its `qdue`
--   empty; a process that noted the tenant within idle_ms may admit without noting again, so
--   a recent score keeps it.
-- Reply: 1 if it changed the index, else 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] == 'note' then
  return redis.call('ZADD', KEYS[1], 'GT', 'CH', now, ARGV[2])
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
if score and tonumber(score) <= now - tonumber(ARGV[3]) then
  return redis.call('ZREM', KEYS[1], ARGV[2])
end
return 0
