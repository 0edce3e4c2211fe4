-- Reap sessions whose deadline has passed, and first undo grants left unclaimed past their
-- claim window: the waiter's gateway never collected the mail (it is gone), so nobody has
-- seen the session; its sandbox goes back to its pool (or the next waiter), with no tombstone,
-- and its quota lease is queued for return.
-- KEYS: sbs, expiry, doomed, active, unclaimed, qret
-- ARGV: limit
-- Reply (`Reaped`): {ended = [Ended...], unclaimed = [session...]}
local now = now_ms()
local limit = tonumber(ARGV[1])
local unclaimed = {}
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', K.unclaimed(), '-inf', now, 'LIMIT', 0, limit)) do
  local h = to_map(redis.call('HGETALL', K.ses(sid)))
  if h.tenant == nil then
    redis.call('ZREM', K.unclaimed(), sid)
  else
    unlease(sid, h, now, true)
    unclaimed[#unclaimed + 1] = sid
  end
end
local due = redis.call('ZRANGEBYSCORE', K.expiry(), '-inf', now, 'LIMIT', 0, limit)
local ended = {}
for _, sid in ipairs(due) do
  local h = to_map(redis.call('HGETALL', K.ses(sid)))
  if h.tenant == nil then
    redis.call('ZREM', K.expiry(), sid)
  else
    local reason = 'expired'
    if now >= tonumber(h.hard_ms) then reason = 'max_lifetime' end
    ended[#ended + 1] = release(sid, h, reason, now)
  end
end
return reply({ ended = ended, unclaimed = unclaimed })
