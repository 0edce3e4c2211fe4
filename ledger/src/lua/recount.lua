-- Recount the queues of the given templates from their lists: an entry whose waiter is gone
-- (its record expired with the gateway that held it, or its tenant's list expired) is dropped,
-- the ring keeps each tenant that still has waiting requests once, in its order, and wcount
-- becomes the number of requests that really wait. Run on every reap tick, so wcount (which
-- the planner creates for, and the queue's cap is checked against) cannot drift for longer.
-- O(waiting requests) of the templates.
-- KEYS: sbs, then wring:t and wcount:t of each template
-- ARGV: template...
-- Reply (`Recounted`): {dropped}
local dropped = 0
for _, template in ipairs(ARGV) do
  local ring = K.wring(template)
  local tenants = redis.call('LRANGE', ring, 0, -1)
  local keep, seen, total = {}, {}, 0
  for _, tenant in ipairs(tenants) do
    if not seen[tenant] then
      seen[tenant] = true
      local tq = K.wq(template, tenant)
      local n = 0
      for _, req in ipairs(redis.call('LRANGE', tq, 0, -1)) do
        if redis.call('EXISTS', K.waiter(req)) == 1 then
          n = n + 1
        else
          redis.call('LREM', tq, 1, req)
          dropped = dropped + 1
        end
      end
      if n > 0 then keep[#keep + 1] = tenant end
      total = total + n
    end
  end
  -- Same length means the same tenants in the same order (`keep` is `tenants` filtered).
  if #keep ~= #tenants then
    redis.call('DEL', ring)
    for _, tenant in ipairs(keep) do redis.call('RPUSH', ring, tenant) end
  end
  if total > 0 then redis.call('SET', K.wcount(template), total) else redis.call('DEL', K.wcount(template)) end
end
return reply({ dropped = dropped })
