-- Retire up to n idle sandboxes of a template (the pool's target went down): they are
-- taken out of the pool and doomed.
-- KEYS: sbs, idle:t, doomed
-- ARGV: template, n
-- Reply: {retired}
local n = 0
for _ = 1, tonumber(ARGV[2]) do
  local sb = pop_idle(ARGV[1])
  if not sb then break end
  redis.call('HSET', K.sb(sb), 'state', 'stopping')
  redis.call('LPUSH', K.doomed(), sb)
  n = n + 1
end
return reply({ retired = n })
