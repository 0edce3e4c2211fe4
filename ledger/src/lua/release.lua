-- End a session on request.
-- KEYS: sbs, ses:sid, expiry, tses:tenant, gone:sid, doomed
-- ARGV: sid, tenant (the caller: the owner or an ancestor), reason
-- Reply (`Released`): ended {Ended} | missing
local sid, tenant, reason = ARGV[1], ARGV[2], ARGV[3]
local h = to_map(redis.call('HGETALL', K.ses(sid)))
if h.tenant == nil or not owns(tenant, h.tenant, 'subtree') then return reply({ outcome = 'missing' }) end
local e = release(sid, h, reason, now_ms())
e.outcome = 'ended'
return reply(e)
