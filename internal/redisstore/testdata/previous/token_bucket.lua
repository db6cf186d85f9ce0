-- The token_bucket algorithm as released before ns state (commit 1d9ad8c); see lib.lua.
-- Token bucket. State: one integer, the instant (µs) at which the bucket is
-- full again; tokens(now) = capacity - (full - now) * rate. The key expires
-- when the bucket would be full, so idle clients cost no memory.

-- The instant the bucket of key is full again, read at now: never before
-- now, and never more than one capacity of debt ahead (tokens >= -capacity),
-- which is as far as a debit goes (debit.lua). A stored instant beyond that
-- was left by a larger capacity or a lower rate (a rule changed under an
-- active key): it is written back as the bound, which reads the same, so the
-- key waits at most (cost + capacity) / rate of the new rule and its debt
-- refills from there. Mirrors Limit.clampDebt in pkg/bucket.
local function token_bucket_full(key, cap, rate, now)
  local full = tonumber(read_string(key) or now) or now
  local most = now + round_us(2 * cap * 1e6 / rate)
  if full > most then
    full = most
    redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
  end
  if full < now then full = now end
  return full
end

-- Returns allowed, remaining, retry_us, reset_us, and on success a commit.
local function token_bucket(key, cap, rate, cost, now)
  local full = token_bucket_full(key, cap, rate, now)
  local tokens = cap - (full - now) * rate / 1e6
  if tokens >= cost then
    full = full + round_us(cost * 1e6 / rate)
    return 1, math.max(cap - (full - now) * rate / 1e6, 0), 0, full - now, function()
      redis.call('SET', key, fmt_int(full), 'PX', fmt_int(math.ceil((full - now) / 1000)))
    end
  end
  return 0, math.max(tokens, 0), ceil_us((cost - tokens) * 1e6 / rate), full - now, nil
end
