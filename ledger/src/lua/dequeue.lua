-- A waiter gives up (deadline): leave the queue, unless a sandbox was granted meanwhile.
-- KEYS: sbs, waiter:request, wq:t:tenant, wring:t, wcount:t, mail:request
-- ARGV: request id, template, tenant
-- Reply (`Dequeued`): removed | mail {mail} | missing
local req, template, tenant = ARGV[1], ARGV[2], ARGV[3]
if redis.call('DEL', K.waiter(req)) == 1 then
  local tq = K.wq(template, tenant)
  redis.call('LREM', tq, 0, req)
  if redis.call('LLEN', tq) == 0 then redis.call('LREM', K.wring(template), 0, tenant) end
  if redis.call('DECR', K.wcount(template)) < 0 then redis.call('SET', K.wcount(template), 0) end
  return reply({ outcome = 'removed' })
end
local mail = redis.call('GETDEL', K.mail(req))
if mail then return reply({ outcome = 'mail', mail = cjson.decode(mail) }) end
return reply({ outcome = 'missing' })
