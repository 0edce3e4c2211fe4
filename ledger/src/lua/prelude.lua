-- Shared helpers, prepended to every script (sandpool ledger).
-- ARGV[1] is always the node's key base "<prefix>:{<node>}:"; every key a script touches
-- starts with it, so a script's keys share one hash tag (one Redis Cluster slot).
local base = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function to_map(flat)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end

-- End a session: forget it, doom its sandbox (never reused), leave a tombstone saying why.
local function release(sid, h, reason, now)
  redis.call('DEL', base .. 'ses:' .. sid)
  redis.call('ZREM', base .. 'expiry', sid)
  local sbkey = base .. 'sb:' .. h.sandbox
  if redis.call('EXISTS', sbkey) == 1 then
    redis.call('HSET', sbkey, 'state', 'stopping')
    redis.call('LPUSH', base .. 'doomed', h.sandbox)
  end
  local gone = base .. 'gone:' .. sid
  redis.call('HSET', gone, 'tenant', h.tenant, 'reason', reason, 'at_ms', now)
  redis.call('PEXPIRE', gone, 3600000)
end
