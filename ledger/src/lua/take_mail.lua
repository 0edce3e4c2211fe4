-- Collect a queued request's outcome, if it has one. A grant collected is claimed: the reaper
-- no longer gives it back (`grant_waiter`).
-- KEYS: sbs, mail:request, unclaimed
-- ARGV: request id
-- Reply (`Taken`): {mail = Mail} | {}
local mail = claim(redis.call('GETDEL', K.mail(ARGV[1])))
if not mail then return reply({}) end
return '{"mail":' .. mail .. '}'
