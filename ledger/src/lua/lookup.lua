-- Look a session up for a tenant, reaping it on the spot if it has expired.
-- ARGV: base, sid, tenant, mode ('touch' counts as activity, 'peek' does not), hold_ms
-- (a touch for a command that may run hold_ms keeps the session busy, not idle, that long).
-- Returns {'ok', now_ms, field, value, ...} | {'gone', reason, at_ms} | {'missing'}.
local sid, tenant, mode = ARGV[2], ARGV[3], ARGV[4]
local flat = redis.call('HGETALL', base .. 'ses:' .. sid)
if #flat == 0 then
  local g = to_map(redis.call('HGETALL', base .. 'gone:' .. sid))
  if g.tenant == tenant then return {'gone', g.reason, g.at_ms} end
  return {'missing'}
end
local h = to_map(flat)
if h.tenant ~= tenant then return {'missing'} end
local now = now_ms()
local idle, hard = tonumber(h.idle_ms), tonumber(h.hard_ms)
local busy = tonumber(h.busy_ms or '0')
if now >= deadline(h) then
  local reason = 'expired'
  if now >= hard then reason = 'max_lifetime' end
  release(sid, h, reason, now)
  return {'gone', reason, tostring(now)}
end
if mode == 'touch' and (h.paused_ms == nil or h.paused_ms == '0') then
  busy = math.max(busy, now + tonumber(ARGV[5] or '0'))
  redis.call('HSET', base .. 'ses:' .. sid, 'last_ms', now, 'busy_ms', busy)
  redis.call('ZADD', base .. 'expiry', math.min(math.max(now, busy) + idle, hard), sid)
  for i = 1, #flat, 2 do
    if flat[i] == 'last_ms' then flat[i + 1] = tostring(now) end
  end
end
local out = {'ok', tostring(now)}
for i = 1, #flat do out[#out + 1] = flat[i] end
return out
