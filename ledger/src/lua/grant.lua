-- Lease a sandbox to a new session: pop an idle one (warm) or take the given one (cold,
-- which must be 'creating'). Records the session, its deadlines (Redis TIME) and a fencing
-- token that grows on every grant. Returns {sandbox, fence, now_ms} or nil when none is idle.
-- ARGV: base, sid, tenant, template, ttl_ms, idle_ms, labels_json, session_key, node, sandbox
local sid, tenant, template = ARGV[2], ARGV[3], ARGV[4]
local ttl, idle = tonumber(ARGV[5]), tonumber(ARGV[6])
local sb = ARGV[10]
if sb == '' then
  sb = nil
  local idle_key = base .. 'idle:' .. template
  -- Skip entries whose sandbox left the idle state behind the list's back (bounded).
  for _ = 1, 64 do
    local cand = redis.call('RPOP', idle_key)
    if not cand then return nil end
    if redis.call('HGET', base .. 'sb:' .. cand, 'state') == 'idle' then
      sb = cand
      break
    end
  end
  if not sb then return nil end
elseif redis.call('HGET', base .. 'sb:' .. sb, 'state') ~= 'creating' then
  return redis.error_reply('sandbox ' .. sb .. ' is not being created')
end
local now = now_ms()
local fence = redis.call('INCR', base .. 'fence')
local hard = now + ttl
redis.call('HSET', base .. 'sb:' .. sb, 'state', 'leased', 'session', sid, 'fence', fence, 'leased_ms', now)
redis.call('HSET', base .. 'ses:' .. sid,
  'tenant', tenant, 'sandbox', sb, 'template', template, 'node', ARGV[9], 'fence', fence,
  'created_ms', now, 'last_ms', now, 'idle_ms', idle, 'hard_ms', hard,
  'labels', ARGV[7], 'key', ARGV[8])
redis.call('ZADD', base .. 'expiry', math.min(now + idle, hard), sid)
return {sb, tostring(fence), tostring(now)}
