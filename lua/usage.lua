-- What a check would see now, for several rules, changing nothing: no
-- state is written, no debt clamped, no log trimmed, no key of another
-- type deleted. KEYS the buckets, of one slot; ARGV
-- five per bucket: algorithm, capacity, rate (tokens/s) or window (µs),
-- cost, and the fraction of the capacity the check keeps for higher
-- priority classes (token bucket and GCRA; 0: none). Replies four values per bucket as multi_main.lua does: allowed
-- (would a check of the cost pass), remaining before any spend (see
-- lua.go), retry_us, reset_us; then the instant (µs) it read at. Mirrors
-- Limit.Usage in pkg/bucket.
local now = now_us()
local usages = {
  token_bucket = instant_usage,
  gcra = instant_usage,
  sliding_window = sliding_window_usage,
  sliding_log = sliding_log_usage,
  fixed_window = fixed_window_usage,
}
local out = {}
for i = 1, #KEYS do
  local j = (i - 1) * 5
  local usage = usages[ARGV[j + 1]]
  if not usage then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[j + 1]))
  end
  local allowed, remaining, retry, reset =
    usage(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]), now, tonumber(ARGV[j + 5]))
  out[#out + 1] = allowed
  out[#out + 1] = remaining
  out[#out + 1] = retry
  out[#out + 1] = reset
end
out[#out + 1] = now
return out
