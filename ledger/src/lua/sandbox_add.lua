-- Record a sandbox the node is about to create.
-- KEYS: sbs, sb:sandbox
-- ARGV: sandbox, template
-- Reply: {created_ms}
local now = now_ms()
redis.call('HSET', K.sb(ARGV[1]), 'template', ARGV[2], 'state', 'creating', 'created_ms', now)
redis.call('SADD', K.sbs(), ARGV[1])
return reply({ created_ms = now })
