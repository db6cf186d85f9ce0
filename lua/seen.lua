-- Records the first delivery of one spend message, named by its origin
-- (source region, instance, flush sequence, part), not by its place in the
-- stream: the same flush published again (without its message id, or after
-- the stream's duplicate window) is a new stream message under the same name.
-- KEYS[1]: the message's record; ARGV[1]: this delivery's stream sequence;
-- ARGV[2]: the record's expiry (ms), longer than the stream keeps a message.
-- Replies the stream sequence of the first delivery: ARGV[1] for the first
-- one and for a redelivery of it, another for a replay.
local first = redis.call('GET', KEYS[1])
if first then
  return first
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
