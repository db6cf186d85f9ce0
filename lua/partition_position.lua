-- The position a partition of another region's spends is applied up to:
-- the stream sequence of its last message applied (or deferred to the
-- retry stream), in one inbound stream (one key per stream epoch).
-- KEYS[1]: the position; KEYS[2]: the partition's lease (same slot).
-- ARGV[1]: the sequence reached; ARGV[2]: the position's life (ms);
-- ARGV[3]: the token of the lease's holder.
-- The position never goes back: it becomes the larger of ARGV[1] and what
-- it holds. It is written only while the token holds the lease; replies
-- the position after, or -1 when the token does not hold the lease.
if redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return -1
end
local cur = redis.call('GET', KEYS[1])
if not cur or tonumber(ARGV[1]) > tonumber(cur) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return tonumber(ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return tonumber(cur)
