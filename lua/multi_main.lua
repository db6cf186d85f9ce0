-- Several rules of one client at once, all or nothing: KEYS the buckets
-- (one hash tag, so one slot); ARGV four per bucket: algorithm, capacity,
-- rate (tokens/s) or window (µs), cost; then one per bucket, in the same
-- order: the fraction of the capacity the request keeps for higher
-- priority classes (0 for none; read by a token bucket or GCRA only, see
-- instant_take). Every bucket is decided before any
-- is written; only when all allow are they all spent. Replies four values
-- per bucket: allowed, remaining (see lua.go), retry_us, reset_us; then the
-- instant (µs) it decided at, which an undo of its spends needs (undo.lua).
local now = now_us()
local takes = {
  token_bucket = token_bucket,
  gcra = gcra,
  sliding_window = sliding_window,
  sliding_log = sliding_log,
  fixed_window = fixed_window,
}
local out, commits, all = {}, {}, true
local n = #KEYS
for i = 1, n do
  local j = (i - 1) * 4
  local take = takes[ARGV[j + 1]]
  if not take then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[j + 1]))
  end
  local allowed, remaining, retry, reset, commit =
    take(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]), now, tonumber(ARGV[4 * n + i]))
  if allowed == 0 then all = false end
  commits[i] = commit
  out[#out + 1] = allowed
  out[#out + 1] = remaining
  out[#out + 1] = retry
  out[#out + 1] = reset
end
if all then
  for i = 1, #KEYS do commits[i]() end
end
out[#out + 1] = now
return out
