-- A template cannot start sandboxes: tell every waiter now, rather than at its deadline.
-- ARGV: base, template, cause, until_ms. Returns how many waiters were told.
local n = 0
for _ = 1, 100000 do
  local req, w = next_waiter(ARGV[2])
  if req == nil then break end
  if w then
    deliver(req, w.channel, 'err ' .. ARGV[4] .. ' ' .. ARGV[3])
    n = n + 1
  end
end
return n
