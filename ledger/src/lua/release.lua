-- End a session on request. ARGV: base, sid, tenant, reason.
-- Returns {'ok', sandbox, session_key} or {'missing'}.
local sid, tenant, reason = ARGV[2], ARGV[3], ARGV[4]
local h = to_map(redis.call('HGETALL', base .. 'ses:' .. sid))
if h.tenant == nil or h.tenant ~= tenant then return {'missing'} end
release(sid, h, reason, now_ms())
return {'ok', h.sandbox, h.key}
