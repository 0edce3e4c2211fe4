-- Undo a grant that nobody has seen: a create whose quota admission, sent beside its checkout,
-- was refused, or a queued grant that raced a warm one. No call ever reached the sandbox, so it
-- is not doomed: it goes to the longest waiter of its template, else back to its pool
-- (`unlease`). The session is forgotten without a tombstone and without a quota return (the
-- caller settles its lease).
-- KEYS: sbs, ses:sid, expiry, tses:tenant, active, unclaimed
-- ARGV: sid
-- Reply (`Ungranted`): {undone}
local sid = ARGV[1]
local h = to_map(redis.call('HGETALL', K.ses(sid)))
if h.tenant == nil then return reply({ undone = false }) end
unlease(sid, h, now_ms(), false)
return reply({ undone = true })
