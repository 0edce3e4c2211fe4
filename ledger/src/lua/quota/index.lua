-- Index the leases an older build admitted (no `qdue` entry): once per scope, at a node's
-- start, so the sweep that reads only `qdue` still finds them. Leases that end by themselves
-- (reservations `r:`, asynchronous invocations `ai:`/`ak:`) and ones without a deadline are
-- not the sweep's (it skipped them before the index too).
-- ARGV: none
-- Reply: {indexed} (how many leases it added to `qdue`)
local n = 0
local flat = redis.call('HGETALL', LEASE)
for i = 1, #flat, 2 do
  local id = flat[i]
  local own = string.sub(id, 1, 2) == 'r:' or string.sub(id, 1, 3) == 'ai:' or string.sub(id, 1, 3) == 'ak:'
  if not own and redis.call('ZSCORE', DUE, id) == false then
    local l = cjson.decode(flat[i + 1])
    if (l.deadline_ms or 0) > 0 then
      redis.call('ZADD', DUE, l.deadline_ms, id)
      n = n + 1
    end
  end
end
return cjson.encode({ indexed = n })
