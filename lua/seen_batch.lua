-- Records the first delivery of several spend messages, as seen.lua does
-- for one: one call for the records of one Redis Cluster node.
-- KEYS[1]: the first record, which routes the call to the node; the others
-- are not declared (see debit_batch_main.lua).
-- ARGV[1]: the records' expiry (ms); then per record: its key and this
-- delivery's stream position.
-- Replies per record, in order, the position of its first delivery.
local out = {}
for i = 2, #ARGV - 1, 2 do
  local first = redis.call('GET', ARGV[i])
  if not first then
    redis.call('SET', ARGV[i], ARGV[i + 1], 'PX', ARGV[1])
    first = ARGV[i + 1]
  end
  out[#out + 1] = first
end
return out
