-- Record one request's reservations of one top-level tenant, and drop at most ARGV[1] of that
-- tenant's reservations whose hold has ended. The cost is the request's own items plus the
-- pruning bound: never another tenant's reservations, never all of the tenant's own. The
-- scope expires with its last hold, so a tenant that stops reserving leaves nothing behind.
-- KEYS: resv, rends (one top-level tenant's reservation scope, ledger/src/keys.rs)
-- ARGV: prune, then per reservation: id, JSON, ends_ms
-- Reply: {pruned, live}
local RESV, RENDS = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prune = tonumber(ARGV[1])
local pruned = 0
if prune > 0 then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', RENDS, '-inf', '(' .. now, 'LIMIT', 0, prune)) do
    redis.call('HDEL', RESV, id)
    redis.call('ZREM', RENDS, id)
    pruned = pruned + 1
  end
end
for i = 2, #ARGV, 3 do
  redis.call('HSET', RESV, ARGV[i], ARGV[i + 1])
  redis.call('ZADD', RENDS, ARGV[i + 2], ARGV[i])
end
local last = redis.call('ZRANGE', RENDS, -1, -1, 'WITHSCORES')
if #last == 2 then
  local at = math.max(tonumber(last[2]), now) + 60000
  redis.call('PEXPIREAT', RESV, at)
  redis.call('PEXPIREAT', RENDS, at)
end
return cjson.encode({ pruned = pruned, live = redis.call('ZCARD', RENDS) })
