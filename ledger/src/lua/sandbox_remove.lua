-- Forget a sandbox (its container is gone or going). A session on it ends with `reason`.
-- ARGV: base, sandbox, reason. Returns {sid, tenant, session_key} of an ended session, or {}.
local sb, reason = ARGV[2], ARGV[3]
local key = base .. 'sb:' .. sb
local h = to_map(redis.call('HGETALL', key))
if h.template then redis.call('LREM', base .. 'idle:' .. h.template, 0, sb) end
redis.call('SREM', base .. 'sbs', sb)
redis.call('DEL', key)
if h.session then
  local s = to_map(redis.call('HGETALL', base .. 'ses:' .. h.session))
  if s.tenant then
    release(h.session, s, reason, now_ms())
    return {h.session, s.tenant, s.key}
  end
end
return {}
