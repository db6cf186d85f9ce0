-- The position a partition of another region's spends is applied up to:
-- the stream sequence of its last message applied (or deferred to the
-- retry stream), in one inbound stream (one key per stream epoch).
-- KEYS[1]: the position; ARGV[1]: the sequence reached; ARGV[2]: the
-- position's life (ms).
-- The position never goes back: it becomes the larger of ARGV[1] and what
-- it holds. Replies the position after.
local cur = redis.call('GET', KEYS[1])
if not cur or tonumber(ARGV[1]) > tonumber(cur) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return tonumber(ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return tonumber(cur)
