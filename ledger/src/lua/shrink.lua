-- Retire up to n idle sandboxes of a template (the pool's target went down): they are
-- taken out of the pool and doomed. ARGV: base, template, n. Returns how many.
local n = 0
for _ = 1, tonumber(ARGV[3]) do
  local sb = pop_idle(ARGV[2])
  if not sb then break end
  redis.call('HSET', base .. 'sb:' .. sb, 'state', 'stopping')
  redis.call('LPUSH', base .. 'doomed', sb)
  n = n + 1
end
return n
