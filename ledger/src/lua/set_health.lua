-- A template cannot start sandboxes: record why and until when (Redis clock), and tell every
-- request waiting for it now rather than at its deadline.
-- KEYS: sbs, health:t, wring:t, wcount:t
-- ARGV: template, cause, back-off ms, error code ('' for the default, `unavailable`)
-- Reply (`HealthSet`): {until_ms, told}
local template, cause = ARGV[1], ARGV[2]
local code = ARGV[4] ~= '' and ARGV[4] or nil
local until_ms = now_ms() + tonumber(ARGV[3])
local hkey = K.health(template)
redis.call('HSET', hkey, 'cause', cause, 'until_ms', until_ms, 'code', ARGV[4])
redis.call('PEXPIRE', hkey, 3600000)
local told = 0
for _ = 1, 100000 do
  local req, w = next_waiter(template)
  if req == nil then break end
  if w then
    deliver(req, w.channel, { outcome = 'failed', cause = cause, until_ms = until_ms, code = code })
    told = told + 1
  end
end
return reply({ until_ms = until_ms, told = told })
