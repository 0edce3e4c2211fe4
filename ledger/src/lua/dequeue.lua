-- A waiter gives up (deadline): leave the queue, unless a sandbox was granted meanwhile.
-- ARGV: base, request id, template, tenant
-- Returns {'removed'} | {'mail', message} | {'missing'}
local req, template, tenant = ARGV[2], ARGV[3], ARGV[4]
local wkey = base .. 'waiter:' .. req
if redis.call('DEL', wkey) == 1 then
  local tq = base .. 'wq:' .. template .. ':' .. tenant
  redis.call('LREM', tq, 0, req)
  if redis.call('LLEN', tq) == 0 then redis.call('LREM', base .. 'wring:' .. template, 0, tenant) end
  if redis.call('DECR', base .. 'wcount:' .. template) < 0 then redis.call('SET', base .. 'wcount:' .. template, 0) end
  return {'removed'}
end
local mail = redis.call('GETDEL', base .. 'mail:' .. req)
if mail then return {'mail', mail} end
return {'missing'}
