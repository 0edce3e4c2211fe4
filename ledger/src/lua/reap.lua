-- Reap sessions whose deadline has passed. ARGV: base, limit.
-- Returns {sid, tenant, session_key, reason, ...} of the sessions it ended.
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', base .. 'expiry', '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, sid in ipairs(due) do
  local h = to_map(redis.call('HGETALL', base .. 'ses:' .. sid))
  if h.tenant == nil then
    redis.call('ZREM', base .. 'expiry', sid)
  else
    local reason = 'expired'
    if now >= tonumber(h.hard_ms) then reason = 'max_lifetime' end
    release(sid, h, reason, now)
    out[#out + 1] = sid
    out[#out + 1] = h.tenant
    out[#out + 1] = h.key
    out[#out + 1] = reason
  end
end
return out
