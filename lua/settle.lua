-- Settles a spend made as an estimate with its actual cost, once.
-- KEYS[1] the bucket, KEYS[2] the settlement's record (in the bucket's
-- slot); ARGV algorithm, capacity, rate (tokens/s) or window (µs), the
-- estimate, the actual cost, the instant (µs) the estimate was spent at,
-- the record's expiry (ms), the settlement's id (tags the entries of a
-- sliding log's extra). When the record exists the settlement was
-- settled before: nothing changes and the reply is {0, the recorded actual
-- cost}. Otherwise an actual cost below the estimate gives the difference
-- back as undo.lua does (never more than was spent, nothing of a window
-- gone since), one above it spends the extra as a debit does (into debt, up
-- to the same bound); the record keeps the actual cost, and the reply is
-- {1, actual cost}. Mirrors Memory.Settle in pkg/bucket.
local now = now_us()
local done = redis.call('GET', KEYS[2])
if done then
  return {0, done}
end
local alg, cap, rw = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local estimate, actual, at = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local d = actual - estimate
if d < 0 then
  local undo = undos[alg]
  if undo then undo(KEYS[1], cap, rw, -d, now, at) end
elseif d > 0 then
  local debit = debits[alg]
  if debit then debit(KEYS[1], cap, rw, d, now, now, 's' .. ARGV[8]) end
end
redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[7])
return {1, ARGV[5]}
