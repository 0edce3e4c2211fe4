-- Record a sandbox the node is about to create. ARGV: base, sandbox, template.
redis.call('HSET', base .. 'sb:' .. ARGV[2], 'template', ARGV[3], 'state', 'creating', 'created_ms', now_ms())
redis.call('SADD', base .. 'sbs', ARGV[2])
return 1
