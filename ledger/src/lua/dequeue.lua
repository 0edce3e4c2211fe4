-- A waiter leaves the queue: at its deadline, unless a sandbox was granted meanwhile (that
-- grant is collected, so claimed: the caller uses it or undoes it); or, with mode 'withdraw',
-- because it is gone (its client hung up): a grant that raced it is undone at once (`unlease`:
-- nobody will ever see it).
-- KEYS: sbs, waiter:request, wq:t:tenant, wring:t, wcount:t, mail:request, unclaimed
-- ARGV: request id, template, tenant, mode ('' | 'withdraw')
-- Reply (`Dequeued`): removed | mail {mail} | missing | undone
local req, template, tenant = ARGV[1], ARGV[2], ARGV[3]
if redis.call('DEL', K.waiter(req)) == 1 then
  local tq = K.wq(template, tenant)
  redis.call('LREM', tq, 0, req)
  if redis.call('LLEN', tq) == 0 then redis.call('LREM', K.wring(template), 0, tenant) end
  if redis.call('DECR', K.wcount(template)) < 0 then redis.call('SET', K.wcount(template), 0) end
  return reply({ outcome = 'removed' })
end
local mail = redis.call('GETDEL', K.mail(req))
if not mail then return reply({ outcome = 'missing' }) end
if ARGV[4] == 'withdraw' then
  local sid = cjson.decode(mail).session_id
  local h = sid and to_map(redis.call('HGETALL', K.ses(sid))) or {}
  if h.tenant then unlease(sid, h, now_ms(), false) end
  return reply({ outcome = 'undone' })
end
return '{"outcome":"mail","mail":' .. claim(mail) .. '}'
