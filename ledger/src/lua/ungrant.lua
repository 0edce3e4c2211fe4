-- Undo a grant that nobody has seen: a create whose quota admission, sent beside its checkout,
-- was refused. No call ever reached the sandbox, so it is not doomed: it goes to the longest
-- waiter of its template, else back to its pool. The session is forgotten without a tombstone
-- and without a quota return (its admission took no lease).
-- KEYS: sbs, ses:sid, expiry, tses:tenant, active
-- ARGV: sid
-- Reply (`Ungranted`): {undone}
local sid = ARGV[1]
local h = to_map(redis.call('HGETALL', K.ses(sid)))
if h.tenant == nil then return reply({ undone = false }) end
redis.call('DEL', K.ses(sid))
redis.call('ZREM', K.expiry(), sid)
redis.call('SREM', K.tses(h.tenant), sid)
if redis.call('HINCRBY', K.active(), h.tenant, -1) <= 0 then redis.call('HDEL', K.active(), h.tenant) end
local key = K.sb(h.sandbox)
if redis.call('HGET', key, 'state') == 'leased' and redis.call('HGET', key, 'session') == sid then
  redis.call('HDEL', key, 'session', 'leased_ms')
  if not grant_waiter(h.sandbox, h.template, now_ms()) then
    redis.call('HSET', key, 'state', 'idle')
    redis.call('RPUSH', K.idle(h.template), h.sandbox)
  end
end
return reply({ undone = true })
